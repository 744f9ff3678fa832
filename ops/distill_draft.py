"""Distil a small draft model from the target (SmolLM2-135M-Instruct) on the CPU.

The draft is a ``LlamaForCausalLM`` with the target's config but ``--layers`` decoder layers
(same hidden size, vocabulary and tokenizer, tied embeddings), initialised from the target:
embeddings / lm_head, final norm, and the target layers picked by ``--init``:

* ``first``: layers 0..L-1 (an early exit of the target),
* ``spread``: L layers evenly spaced over the stack, first and last included,
* ``ends``: layers 0..L-2 and the last layer,
* or an explicit comma list such as ``0,1,2,29``.

``spread`` is the default: measured on the validation prompts (4 layers, 4 training prompts per
category, 40 steps), held-out top-k KL went 12.75 -> 4.73 from ``spread`` and 15.15 -> 7.17 from
``first`` (``ends`` starts at 23.25); top-1 agreement was 0.147 for both.

Training is distillation (Hinton et al. 2015, as in DistillSpec): the draft minimises the
cross-entropy to the target's next-token distribution restricted to the target's top-k
tokens (``--topk``; the gradient of KL(p_target || p_draft) on those tokens). Embeddings
and lm_head (tied, 28M of the 135M parameters) are frozen; only the decoder layers and the
final norm train. The teacher data is computed once and cached under ``ops/out/distill_cache``:
the target's greedy continuations (``--gen-tokens``, what the draft must predict when serving)
of SpecBench prompts, with the target's top-k log-probabilities on every continuation
position and on the last ``--prompt-loss-tokens`` prompt positions.

Held-out split: ``ops/measure_acceptance.py`` measures on the first ``--per-category``
prompts of each category (``load_prompts``). This script never trains on the first
``--holdout`` (16) prompts of each category; the next ``--val-per-category`` (2) prompts
of each category are the validation set (held-out top-k KL and top-1 agreement in the log);
training uses the next ``--train-per-category`` (40) prompts of each category (0: all 62 left).

The checkpoint directory (config.json, model.safetensors, tokenizer files, distill.json with
the arguments and the log) loads with ``DraftModelRunner.from_pretrained(dir)`` or
``--draft dir`` wherever a draft spec is taken. Seeds are fixed; ``--steps 0`` saves the
untrained initialisation (for a side-by-side acceptance measurement).

    python ops/distill_draft.py                                   # defaults: 35 min on 2 busy cores
    python ops/distill_draft.py --steps 0 --out ops/out/smollm2-draft-init
    python ops/distill_draft.py --compare-inits first spread ends 0,1,2,29  # held-out KL of each init, no training
    python ops/measure_acceptance.py --drafter draft-model --draft ops/out/smollm2-draft --per-category 8
"""

from __future__ import annotations

import os

# Two threads on a box whose other core is busy: OpenMP's default spin-waiting made a forward
# pass 10x slower than one thread (measured); passive waiting removes that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_acceptance import load_prompts  # noqa: E402

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel

log = logging.getLogger("distill_draft")

OUT = REPO / "ops" / "out" / "smollm2-draft"  # git-ignored (/ops/out/)
CACHE = REPO / "ops" / "out" / "distill_cache"
HOLDOUT = 16  # >= the largest --per-category measure_acceptance.py is run with


@dataclass
class Sample:
    """One sequence with the teacher's top-k next-token log-probabilities on its loss positions."""

    ids: torch.Tensor  # (T,) prompt + greedy continuation
    start: int  # loss positions are start..T-2 (the logits there predict tokens start+1..T-1)
    topk_idx: torch.Tensor  # (T-1-start, k) int64: the teacher's top-k token ids
    topk_logp: torch.Tensor  # (T-1-start, k) float32: their log-probabilities under the teacher


# ---------------------------------------------------------------- data
def split_prompts(holdout: int = HOLDOUT, val_per_category: int = 2,
                  train_per_category: int | None = None) -> tuple[list[str], list[str]]:
    """(train, validation) prompt texts; the first ``holdout`` of each category are never used."""
    train, val = [], []
    for _cat, texts in sorted(load_prompts(10_000).items()):
        rest = texts[holdout:]
        val += rest[:val_per_category]
        train += rest[val_per_category:][:train_per_category]
    return train, val


def encode_prompts(tokenizer: Any, texts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Chat-formatted ids; the user text is cut to its first ``max_prompt_tokens`` tokens
    (long articles), so the template and the end of the turn stay intact."""
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_tokens:
            text = tokenizer.decode(ids[:max_prompt_tokens])
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        if isinstance(chat, dict) or hasattr(chat, "input_ids"):
            chat = chat["input_ids"]
        out.append(list(chat))
    return out


@torch.no_grad()
def teacher_samples(target: PreTrainedModel, prompts: list[list[int]], gen_tokens: int, topk: int,
                    prompt_loss_tokens: int, batch_size: int = 16, eos_id: int | None = None) -> list[Sample]:
    """The target's greedy continuations of ``prompts`` and its top-k log-probs on the last
    ``prompt_loss_tokens`` prompt positions and every continuation position.

    ``generate`` (left padding, batches of similar length) gives the continuation logits; a hook on
    the final norm catches the prefill's hidden states for the prompt positions."""
    pad = eos_id if eos_id is not None else 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    captured: list[torch.Tensor] = []
    hook = target.model.norm.register_forward_hook(
        lambda _m, _i, out: captured.append(out[:, -prompt_loss_tokens:]) if not captured else None)
    saved_eos = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = eos_id
    samples: dict[int, Sample] = {}
    try:
        for b in range(0, len(order), batch_size):
            rows = order[b:b + batch_size]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long, device=target.device)
            mask = torch.zeros_like(ids)
            for r, i in enumerate(rows):
                ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[r, width - len(prompts[i]):] = 1
            captured.clear()
            out = target.generate(ids, attention_mask=mask, max_new_tokens=gen_tokens, do_sample=False,
                                  pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
            prefill = target.lm_head(captured[0]).float().log_softmax(-1)  # (B, M, V), last M prompt positions
            steps = torch.stack(out.logits[1:], 1).float().log_softmax(-1) if len(out.logits) > 1 else None
            for r, i in enumerate(rows):
                gen = out.sequences[r, width:].tolist()
                n = len(gen)
                if eos_id is not None and eos_id in gen:
                    n = gen.index(eos_id) + 1  # keep the end-of-turn token: the draft must predict it too
                m = min(prompt_loss_tokens, len(prompts[i]))
                parts = [prefill[r, prefill.shape[1] - m:]]
                if n > 1 and steps is not None:
                    parts.append(steps[r, :n - 1])  # logits at continuation positions 0..n-2
                lp = torch.cat(parts)
                top = lp.topk(topk, -1)
                seq = torch.tensor(prompts[i] + gen[:n])
                samples[i] = Sample(seq, len(prompts[i]) - m, top.indices.cpu(), top.values.cpu())  # cache: any device
            log.info("teacher: %d/%d sequences", min(b + batch_size, len(order)), len(order))
    finally:
        hook.remove()
        target.generation_config.eos_token_id = saved_eos
    return [samples[i] for i in range(len(prompts))]


def cached_teacher_samples(target: PreTrainedModel, tokenizer: Any, texts: list[str], args: argparse.Namespace,
                           name: str) -> list[Sample]:
    key = json.dumps([texts, args.gen_tokens, args.topk, args.prompt_loss_tokens, args.max_prompt_tokens])
    path = CACHE / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.exists():
        log.info("teacher data from cache %s", path)
        return [Sample(**d) for d in torch.load(path)]
    t0 = time.perf_counter()
    prompts = encode_prompts(tokenizer, texts, args.max_prompt_tokens)
    samples = teacher_samples(target, prompts, args.gen_tokens, args.topk, args.prompt_loss_tokens,
                              args.teacher_batch, eos_id=_eos_id(tokenizer))
    n = sum(len(s.ids) for s in samples)
    log.info("teacher %s: %d prompts, %d tokens, %d loss positions in %.0f s", name, len(samples), n,
             sum(len(s.topk_idx) for s in samples), time.perf_counter() - t0)
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save([s.__dict__ for s in samples], path)
    return samples


def _eos_id(tokenizer: Any) -> int | None:
    """SmolLM2's end of turn (<|im_end|>, id 2) ends every greedy answer."""
    vocab = tokenizer.get_vocab()
    return vocab.get("<|im_end|>", tokenizer.eos_token_id)


# ---------------------------------------------------------------- the draft
def init_layers(init: str, target_layers: int, draft_layers: int) -> list[int]:
    """Target layer indices the draft's layers start from (see the module docstring)."""
    if init == "first":
        return list(range(draft_layers))
    if init == "ends":
        return list(range(draft_layers - 1)) + [target_layers - 1]
    if init == "spread":
        if draft_layers == 1:
            return [0]
        return [round(i * (target_layers - 1) / (draft_layers - 1)) for i in range(draft_layers)]
    picked = [int(x) for x in init.split(",")]
    if len(picked) != draft_layers or not all(0 <= x < target_layers for x in picked):
        raise ValueError(f"--init {init!r}: need {draft_layers} layer indices below {target_layers}")
    return picked


def build_draft(target: PreTrainedModel, layers: list[int]) -> LlamaForCausalLM:
    """A Llama with the target's shapes and ``len(layers)`` decoder layers copied from ``layers``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = target.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "architectures", "model_type", "transformers_version"):
        cfg.pop(k, None)
    cfg.update(num_hidden_layers=len(layers), tie_word_embeddings=True, use_cache=True)
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    weight = next(target.parameters())
    draft = LlamaForCausalLM(config).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        for mine, theirs in zip(draft.model.layers, layers):
            mine.load_state_dict(target.model.layers[theirs].state_dict())
    draft.tie_weights()
    return draft.eval()


def trainable_parameters(draft: LlamaForCausalLM) -> list[torch.nn.Parameter]:
    """Decoder layers and the final norm; embeddings / lm_head (tied) stay frozen."""
    draft.model.embed_tokens.weight.requires_grad_(False)
    draft.lm_head.weight.requires_grad_(False)
    return [p for n, p in draft.named_parameters() if not n.startswith(("model.embed_tokens", "lm_head"))]


def save_draft(draft: PreTrainedModel, out: Path, tokenizer: Any = None, meta: dict | None = None) -> Path:
    """A HF checkpoint directory that ``load_hf`` / ``DraftModelRunner.from_pretrained`` load."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out)
    if tokenizer is not None:
        # load_hf passes dtype / gguf_file to the tokenizer too: not JSON, and not wanted in the copy
        for k in ("dtype", "torch_dtype", "gguf_file"):
            tokenizer.init_kwargs.pop(k, None)
        tokenizer.save_pretrained(out)
    if meta is not None:
        (out / "distill.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


# ---------------------------------------------------------------- training
def _batch(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids (padding after a sequence never reaches its causal positions, so no mask),
    the flat (row, position) loss indices and the teacher's top-k ids / log-probs."""
    width = max(len(s.ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    flat = []
    for r, s in enumerate(samples):
        ids[r, :len(s.ids)] = s.ids
        flat.append(r * width + torch.arange(s.start, len(s.ids) - 1))
    return (ids, torch.cat(flat), torch.cat([s.topk_idx for s in samples]),
            torch.cat([s.topk_logp for s in samples]))


def distill_loss(draft: PreTrainedModel, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cross-entropy to the teacher on its top-k, summed over positions; top-k KL summed; top-1 matches).

    lm_head runs on the loss positions only (it is 28M of the draft's MACs per position)."""
    ids, flat, idx, t_logp = (t.to(draft.device) for t in _batch(samples))
    hidden = draft.model(input_ids=ids, use_cache=False).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])[flat]
    d_logp = draft.lm_head(hidden).float().log_softmax(-1)
    picked = d_logp.gather(1, idx)
    p_t = t_logp.exp()
    ce = -(p_t * picked).sum()
    kl = (p_t * (t_logp - picked)).sum().detach()
    top1 = (d_logp.argmax(-1) == idx[:, 0]).sum()
    return ce, kl, top1


@torch.no_grad()
def evaluate(draft: PreTrainedModel, samples: list[Sample], batch_size: int = 4) -> dict[str, float]:
    """Mean top-k KL(teacher || draft) per position and top-1 agreement with the teacher's argmax."""
    draft.eval()
    kl = top1 = n = 0.0
    for b in range(0, len(samples), batch_size):
        chunk = samples[b:b + batch_size]
        _, k, t = distill_loss(draft, chunk)
        kl += float(k)
        top1 += float(t)
        n += sum(len(s.topk_idx) for s in chunk)
    return {"kl": kl / max(n, 1), "top1": top1 / max(n, 1), "positions": int(n)}


def make_batches(samples: list[Sample], batch_tokens: int, rng: random.Random) -> list[list[Sample]]:
    """An epoch of batches of similar-length sequences, at most ``batch_tokens`` padded tokens each."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    batches: list[list[Sample]] = []
    for c in range(0, len(order), 64):  # sort within chunks: little padding, still shuffled
        chunk = sorted(order[c:c + 64], key=lambda i: len(samples[i].ids))
        cur: list[Sample] = []
        for i in chunk:
            s = samples[i]
            if cur and (len(cur) + 1) * max(len(s.ids), max(len(x.ids) for x in cur)) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(s)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def train(draft: PreTrainedModel, train_set: list[Sample], val_set: list[Sample], steps: int, lr: float = 3e-4,
          batch_tokens: int = 2048, warmup: int = 20, eval_every: int = 50, seed: int = 0,
          max_seconds: float | None = None) -> list[dict]:
    """AdamW on the distillation loss with linear warm-up and cosine decay; returns the log
    (held-out KL / top-1 at step 0, every ``eval_every`` steps and at the end)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    params = trainable_parameters(draft)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))

    history = [{"step": 0, **evaluate(draft, val_set)}]
    log.info("step 0: held-out KL %.4f top-1 %.3f", history[0]["kl"], history[0]["top1"])
    batches: list[list[Sample]] = []
    t0 = time.perf_counter()
    tokens = positions = 0
    run_ce = run_n = 0.0
    for step in range(1, steps + 1):
        if not batches:
            batches = make_batches(train_set, batch_tokens, rng)
        batch = batches.pop()
        draft.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1)
        ce, _, _ = distill_loss(draft, batch)
        n = sum(len(s.topk_idx) for s in batch)
        opt.zero_grad(set_to_none=True)
        (ce / n).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens += sum(len(s.ids) for s in batch)
        positions += n
        run_ce, run_n = run_ce + float(ce.detach()), run_n + n
        elapsed = time.perf_counter() - t0
        last = step == steps or (max_seconds is not None and elapsed > max_seconds)
        if step % eval_every == 0 or last:
            ev = evaluate(draft, val_set)
            history.append({"step": step, **ev, "train_ce": run_ce / run_n, "seconds": round(elapsed, 1),
                            "tokens_per_s": round(tokens / elapsed, 1)})
            log.info("step %d: train CE %.4f, held-out KL %.4f top-1 %.3f (%.0f s, %.0f tok/s, %.0f loss pos/s)",
                     step, run_ce / run_n, ev["kl"], ev["top1"], elapsed, tokens / elapsed, positions / elapsed)
            run_ce = run_n = 0.0
        if last:
            if step < steps:
                log.warning("stopped at step %d of %d: --max-train-minutes reached", step, steps)
            break
    draft.eval()
    return history


# ---------------------------------------------------------------- CLI
def load_target(device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, Any]:
    from gpu_runtime.executor.torch.executor import DEFAULT_MODEL, load_hf
    from gpu_runtime.factory import resolve_device

    return load_hf(DEFAULT_MODEL, resolve_device(device), dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT, help="checkpoint directory to write")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the draft")
    ap.add_argument("--init", default="spread", help="first | spread | ends | comma list of target layers")
    ap.add_argument("--compare-inits", nargs="+", default=[], help="inits to print the held-out KL of, then exit")
    ap.add_argument("--steps", type=int, default=360, help="optimizer steps (0: save the initialisation)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per optimizer step")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=60)
    ap.add_argument("--holdout", type=int, default=HOLDOUT, help="first prompts per category never used")
    ap.add_argument("--val-per-category", type=int, default=2)
    ap.add_argument("--train-per-category", type=int, default=40, help="0: all the rest (62)")
    ap.add_argument("--max-prompt-tokens", type=int, default=256, help="user text cut to this many tokens")
    ap.add_argument("--gen-tokens", type=int, default=64, help="greedy continuation tokens per prompt")
    ap.add_argument("--prompt-loss-tokens", type=int, default=64, help="last prompt positions in the loss")
    ap.add_argument("--topk", type=int, default=32, help="teacher log-probs kept per position")
    ap.add_argument("--teacher-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto", help="auto (a GPU when there is one) | cpu | cuda[:N]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-train-minutes", type=float, default=22.0, help="safety stop (logged) for slow machines")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    target, tokenizer = load_target(args.device)
    target.requires_grad_(False)
    n_target = target.config.num_hidden_layers
    log.info("target loaded in %.1f s", time.perf_counter() - t0)
    train_texts, val_texts = split_prompts(args.holdout, args.val_per_category, args.train_per_category or None)
    val_set = cached_teacher_samples(target, tokenizer, val_texts, args, "val")

    if args.compare_inits:
        for init in args.compare_inits:
            layers = init_layers(init, n_target, args.layers)
            ev = evaluate(build_draft(target, layers), val_set)
            print(f"init {init:8s} layers {layers}: held-out KL {ev['kl']:.4f} top-1 {ev['top1']:.3f}")
        return

    layers = init_layers(args.init, n_target, args.layers)
    draft = build_draft(target, layers)
    log.info("draft: %d layers from target layers %s; %.1fM parameters, %.1fM trained", args.layers, layers,
             sum(p.numel() for p in draft.parameters()) / 1e6,
             sum(p.numel() for p in trainable_parameters(draft)) / 1e6)
    if args.steps > 0:
        train_set = cached_teacher_samples(target, tokenizer, train_texts, args, "train")
        del target  # frees ~540 MB: the teacher data is precomputed
        history = train(draft, train_set, val_set, args.steps, args.lr, args.batch_tokens, args.warmup,
                        args.eval_every, args.seed, args.max_train_minutes * 60)
    else:
        history = [{"step": 0, **evaluate(draft, val_set)}]
        log.info("untrained init: held-out KL %.4f top-1 %.3f", history[0]["kl"], history[0]["top1"])
    meta = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "target_layers": layers, "log": history, "wall_seconds": round(time.perf_counter() - t0, 1)}
    save_draft(draft, args.out, tokenizer, meta)
    print(f"wrote {args.out} ({meta['wall_seconds']:.0f} s); held-out KL {history[0]['kl']:.4f} -> "
          f"{history[-1]['kl']:.4f}, top-1 {history[0]['top1']:.3f} -> {history[-1]['top1']:.3f}")


if __name__ == "__main__":
    main()
