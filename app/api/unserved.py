"""vLLM 0.32's server routes that coserve does not serve, each answered by name: a 404 ``unsupported_endpoint`` that
says why and where to go instead, in OpenAI's shape as vLLM's errors are (Anthropic's for its SDK on its paths),
where an unknown path answers a bare 404. vLLM registers some for another kind of model only, some behind a flag or
its dev mode (``VLLM_SERVER_DEV_MODE``); a vLLM user who turned one on reads here what coserve offers instead.

The routes come before every other router's: ``/v1/chat/completions/render`` would otherwise be read as a stored
chat completion's id. A websocket (``/v1/realtime``) is refused with the same answer, as an HTTP denial response
where the server supports one (uvicorn does), else a close with the reason."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from app.api.errors import anthropic_error, error_api

POOLING, SPEECH = "pooling model (embeddings, classification, scoring: vLLM's --runner pooling)", "speech-to-text model"
REALTIME = "/v1/realtime"  # vLLM's realtime transcription: a websocket
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]  # any method gets the answer (OPTIONS: the allowed ones)
ADMIN_JOBS = "coserve's admin API: GET /admin/api/overview shows the workers and jobs"
DRAIN = ("POST /admin/api/workers/{worker_id}/drain (the admin key) stops a worker taking new jobs, "
         'and {"drain": false} lets it take them again; GET /admin/api/overview shows which are draining')
CANCEL = "cancel a request's job with POST /v1/jobs/{job_id}/cancel (the admin's: POST /admin/api/jobs/{job_id}/cancel)"
WEIGHTS = ("coserve's workers load the model's weights at start (COSERVE_MODEL): start workers with the new weights "
           "and drain the old ones; an adapter loads at runtime with POST /v1/load_lora_adapter")
SCALE_OUT = ("coserve renders prompts and runs the engines itself (no separate render step): POST /tokenize gives "
             "the token ids of a prompt or of chat messages, POST /detokenize their text, and /v1/completions takes "
             "token ids as its prompt")
CHAT_INSTEAD = "send the conversation to POST /v1/chat/completions (OpenAI's) or POST /v1/messages (Anthropic's)"


def another_model(kind: str) -> str:
    return (f"this server runs a generative model (chat, completions, Responses, Messages); vLLM serves this route "
            f"for a {kind} only, so send it to a server that runs one")


def dev_mode(instead: str) -> str:
    return f"vLLM serves it in its dev mode (VLLM_SERVER_DEV_MODE=1) only; {instead}"


# path (a Starlette path template) -> why coserve does not serve it, and what to use instead
UNSERVED: dict[str, str] = {
    **dict.fromkeys(("/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                     "/v1/rerank", "/v2/rerank"), another_model(POOLING)),
    **dict.fromkeys(("/v1/audio/transcriptions", "/v1/audio/translations", REALTIME), another_model(SPEECH)),
    # --enable-scale-out / --tokens-only: a router renders prompts apart from the engines
    **dict.fromkeys(("/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render",
                     "/v1/messages/render", "/v1/chat/completions/derender", "/v1/completions/derender",
                     "/inference/v1/generate"), f"vLLM serves it for disaggregated serving (--enable-scale-out); "
                                                f"{SCALE_OUT}"),
    "/inference/v1/abort_requests": f"vLLM serves it for disaggregated serving (--enable-scale-out); {CANCEL}",
    "/generative_scoring": ("coserve does not serve vLLM's generative scoring; POST /v1/completions with max_tokens 1 "
                            "and logprobs gives the probabilities of the next tokens"),
    "/v1/systemone": f"coserve does not serve vLLM's structured decisions; {CHAT_INSTEAD} with a response_format",
    **dict.fromkeys(("/cohere/v2/chat", "/cohere/v2/chat/render"),
                    f"coserve does not serve Cohere's API (vLLM's with VLLM_ENABLE_COHERE_API=1); {CHAT_INSTEAD}"),
    # the operator's routes of vLLM's dev mode; coserve's admin API does what it can of theirs
    **dict.fromkeys(("/pause", "/resume", "/is_paused"), dev_mode(DRAIN)),
    **dict.fromkeys(("/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory"), dev_mode(
        "coserve's workers do not sleep: " + DRAIN + "; a stopped worker frees its memory")),
    "/abort_requests": dev_mode(CANCEL),
    "/collective_rpc": dev_mode("coserve runs no code sent to its workers"),
    "/server_info": dev_mode(ADMIN_JOBS + "; GET /version the version, GET /v1/models the model"),
    **dict.fromkeys(("/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
                     "/start_draft_weight_update", "/update_weights", "/finish_weight_update",
                     "/update_weight_version", "/weight_info", "/weight_checker", "/get_world_size"),
                    dev_mode(f"its weight transfer is for RL trainers; {WEIGHTS}")),
    **dict.fromkeys(("/scale_elastic_ep", "/is_scaling_elastic_ep"),
                    "coserve does not run vLLM's elastic expert parallelism; it scales by starting workers and "
                    "draining them (POST /admin/api/workers/{worker_id}/drain)"),
    **dict.fromkeys(("/fault_tolerance/apply", "/fault_tolerance/status"),
                    "coserve does not run vLLM's fault tolerance (--enable-fault-tolerance); its supervisor restarts "
                    f"a failed worker and requeues its jobs; {ADMIN_JOBS}"),
    **dict.fromkeys(("/start_profile", "/stop_profile"),
                    "coserve does not run vLLM's profiler (--profiler-config); profile a worker process itself"),
    "/kv_event_sources": "coserve publishes no KV cache events (vLLM's --kv-events-config)",
    # SageMaker's adapter routes (vLLM's with runtime LoRA updating)
    **dict.fromkeys(("/adapters", "/adapters/{adapter_name}"), "coserve loads and unloads adapters at POST "
                                                               "/v1/load_lora_adapter and /v1/unload_lora_adapter"),
}


def unsupported(connection: Request | WebSocket, method: str, template: str) -> JSONResponse:
    """The answer to ``method`` on the unserved route ``template``: why, and what instead, in the shape the path's
    client reads."""
    message = f"{method} {connection.url.path} is not served here: {UNSERVED[template]}"
    if error_api(connection.scope) == "anthropic":
        return anthropic_error(404, message)
    from app.openai_schemas import error_response  # it builds on errors, which this module does too

    return error_response(404, message, type="invalid_request_error", code="unsupported_endpoint")


def _answer(template: str) -> Callable[[Request], Awaitable[JSONResponse]]:
    async def answer(request: Request) -> JSONResponse:
        return unsupported(request, request.method, template)

    return answer


def _refuse(template: str) -> Callable[[WebSocket], Awaitable[None]]:
    async def refuse(websocket: WebSocket) -> None:
        answer = unsupported(websocket, "GET", template)
        if "websocket.http.response" in websocket.scope.get("extensions", {}):
            await websocket.send_denial_response(answer)
        else:  # a close before the handshake carries no reason: accept, then close saying so (1008: policy)
            await websocket.accept()
            await websocket.close(code=1008, reason=f"{websocket.url.path} is not served here; GET it for why")

    return refuse


def routes() -> list[BaseRoute]:
    """A route per unserved path for every method, and a websocket one for vLLM's websocket route."""
    return [*(Route(path, _answer(path), methods=METHODS) for path in UNSERVED),
            WebSocketRoute(REALTIME, _refuse(REALTIME))]
