"""Generate text from a trained run: ``python sample.py --run <run.name | run folder | checkpoint.pt>``.

Loads the run's latest checkpoint (or the given file) onto the chosen device, rebuilds the model
and tokenizer from it (no data cache needed) and prints ``--num-samples`` continuations of
``--prompt``, generated as one batch. Sampling: logits / temperature, optional top-k, multinomial
(nanoGPT's sample.py); ``--top-k 1`` is greedy. With the KV cache (default) the prompt is run once and
each new token is one decode step; ``--compile`` compiles that step, ``--cuda-graph`` (GPU; sdpa, fa2 or fa3)
replays it as one CUDA graph, ``--compile --cuda-graph`` (or ``--compile cudagraphs``) both.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from bench import HelpFormatter
from data.tokenizers import tokenizer_from_meta
from model.backends import REGISTRY, backends_with, resolve_backend
from model.gpt import GPT, GPTConfig
from model.kv_cache import KVCache
from trainer.checkpoint import (WEIGHTS_KEYS, CheckpointError, check_weights, checkpoint_dir, clean_state_dict,
                                latest_checkpoint, load_checkpoint, newest_checkpoint)
from trainer.runtime import NO_CUDA, device_memory


def find_checkpoint(run: str, runs_root: str = "runs") -> Path:
    """A checkpoint file, a run folder or its checkpoints folder (the latest checkpoint), or a run name under
    ``runs_root``."""
    p = Path(run)
    if p.is_file():
        return p
    empty = []  # folders without checkpoints: a run of that name under runs_root still counts (e.g. ./model/)
    for folder in (p, Path(runs_root) / run):
        if folder.is_dir():
            if folder.name == "checkpoints" and not checkpoint_dir(folder).is_dir():  # <run>/checkpoints itself
                folder = folder.parent
            ckpt = newest_checkpoint(folder, "or give that checkpoint's path as --run")
            if ckpt is not None:
                return ckpt
            empty.append(folder)
    for folder in empty:  # a sweep's folder (or a runs root) names the runs it holds
        latest = {p.name: ckpt for p in folder.iterdir() if (ckpt := latest_checkpoint(p)) is not None}
        if latest:  # the run saved last is the likeliest one meant
            newest = max(latest, key=lambda name: (latest[name].stat().st_mtime, name))
            raise CheckpointError(f"run folder {folder} has no checkpoints (checkpoints/step_*.pt); it holds the "
                                  f"runs {', '.join(sorted(latest))}: give --run {folder / newest} (saved last)")
    if empty:
        raise CheckpointError(f"run folder {empty[0]} has no checkpoints (checkpoints/step_*.pt)")
    kinds = "a checkpoint file or a run folder" if p.is_absolute() else \
        f"a checkpoint file, a run folder or a run under {runs_root}/"
    raise CheckpointError(f"--run {run!r} is not {kinds}")


def load_model(ckpt_path: Path, device: str = "cpu", attn: str = "auto"):
    """(model in eval mode on ``device``, tokenizer, checkpoint dict) from a trainer checkpoint, or one stripped to
    ``WEIGHTS_KEYS`` (the optimizer and training state are not read). attn: a backend
    name, or "auto": sdpa, or for a model with attention logit soft-capping (which sdpa lacks) the backend
    ``attn=auto`` trains it with (``resolve_backend``)."""
    ckpt = load_checkpoint(ckpt_path, WEIGHTS_KEYS)
    args = ckpt["model_args"]
    if attn == "auto":
        softcap = bool(args.get("attn_softcap"))
        attn = resolve_backend("auto", args["n_embd"] // args["n_head"], softcap=True).name if softcap else "sdpa"
    model = GPT(GPTConfig(**{**args, "attn": attn, "dropout": 0.0}))
    check_weights(ckpt, model)
    model.load_state_dict(clean_state_dict(ckpt["model"]))
    return model.to(device).eval(), tokenizer_from_meta(ckpt["data_meta"]), ckpt


def _compile_value(value: str) -> str:
    """--compile's optional value: only 'cudagraphs' (bare --compile is True)."""
    if value != "cudagraphs":
        raise argparse.ArgumentTypeError(f"{value!r}: give --compile alone or --compile cudagraphs")
    return value


def start_ids(tokenizer) -> list[int]:
    """What an empty prompt starts from: the document separator (BPE), else a newline (char), else, for a character
    vocabulary without one, its first character."""
    if tokenizer.eot_token is not None:
        return [tokenizer.eot_token]
    try:
        return tokenizer.encode("\n")
    except ValueError:  # a corpus without newlines
        return [0]


def sample(model: GPT, tokenizer, prompt: str, num_tokens: int, temperature: float, top_k: int | None,
           num_samples: int = 1, seed: int = 1337, kv_cache: bool = True, compile: bool | str = False,
           cuda_graph: bool = False) -> list[str]:
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt) if prompt else start_ids(tokenizer)
    x = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    y = model.generate(x, num_tokens, temperature=temperature, top_k=top_k, generator=gen,
                       num_tokens=tokenizer.vocab_size, kv_cache=kv_cache, compile=compile, cuda_graph=cuda_graph)
    return [tokenizer.decode(row[len(ids):].tolist()) for row in y]


def memory_needed(model: GPT, num_samples: int, context: int, kv_cache: bool) -> dict[str, int]:
    """Bytes generation needs at least, by part: the weights; with kv_cache the cache, preallocated for every
    sample's whole block_size (``KVCache.nbytes_for``); each step's float32 logits of the last position; one
    block's input for `context` tokens of every sample. Lower bounds (no other activations)."""
    c = model.config
    p = next(model.parameters())
    parts = {"weights": sum(t.numel() * t.element_size() for t in model.parameters()),
             "logits": num_samples * c.vocab_size * 4,
             "activations": num_samples * min(context, c.block_size) * c.n_embd * p.element_size()}
    if kv_cache:
        parts["KV cache"] = KVCache.nbytes_for(model, num_samples)
    return parts


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A Python warning as one line, its category and message (not the source line that raised it)."""
    print(f"{category.__name__}: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """sample.py's command line; returns the exit status (130 after Ctrl-C: the samples are printed only once all are
    done, so nothing is left half-printed)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("interrupted: no sample printed", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--run", required=True,
                    help="run name (under --runs-root), run folder or its checkpoints folder, or checkpoint file")
    ap.add_argument("--runs-root", default="runs", help="folder holding run folders (train.py's run.root)")
    ap.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    ap.add_argument("--num-tokens", type=int, default=500, help=">= 1; tokens to generate per sample")
    ap.add_argument("--num-samples", type=int, default=1, help=">= 1; samples, generated as one batch")
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="> 0 and finite; lower is more conservative (greedy decoding: --top-k 1)")
    ap.add_argument("--top-k", type=int, default=200, help="keep the k most likely tokens; 0 = all, 1 = greedy")
    ap.add_argument("--seed", type=int, default=1337, help="seed of the sampling, in [0, 2**32) as train.py's")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    ap.add_argument("--attn", default="auto", choices=("auto", *REGISTRY),
                    help="attention backend; auto: sdpa, or for a model with model.attn_softcap the one attn=auto "
                         "trains it with")
    ap.add_argument("--kv-cache", action=argparse.BooleanOptionalAction, default=None,
                    help="cache keys/values: prefill the prompt once, then one decode step per token (default: on, "
                         "off for a model with model.attn_window, which the cache does not take)")
    ap.add_argument("--compile", nargs="?", const=True, default=False, type=_compile_value, metavar="cudagraphs",
                    help="torch.compile the transformer blocks of the per-token step (the fixed-shape decode step "
                         "with --kv-cache); '--compile cudagraphs' = --compile --cuda-graph")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="capture the fixed-shape decode step (eager, or compiled with --compile) as one CUDA graph "
                         f"and replay it per token (GPU, --kv-cache; {', '.join(backends_with('static_decode'))})")
    args = ap.parse_args(argv)
    for name, ok, accepted in (("--num-tokens", args.num_tokens >= 1, ">= 1"),
                               ("--num-samples", args.num_samples >= 1, ">= 1"),
                               ("--temperature", 0 < args.temperature < float("inf"),
                                "> 0 and finite (greedy: --top-k 1)"),
                               ("--top-k", args.top_k >= 0, ">= 0"),
                               ("--seed", 0 <= args.seed < 2**32, "in [0, 2**32)")):
        if not ok:
            ap.error(f"{name}={getattr(args, name[2:].replace('-', '_'))} is out of range: must be {accepted}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: {NO_CUDA}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cpu" and args.attn != "auto" and REGISTRY[args.attn].needs_cuda:
        ap.error(f"--attn {args.attn} needs a CUDA GPU; use --attn sdpa (or fa2/fa3 under Triton's interpreter)")
    graphs = args.compile == "cudagraphs" or args.cuda_graph
    flag = "--compile cudagraphs" if args.compile == "cudagraphs" else "--cuda-graph"
    if graphs and args.kv_cache is False:
        ap.error(f"{flag} needs --kv-cache (it captures the fixed-shape decode step)")
    if device == "cpu" and graphs:
        ap.error(f"{flag} needs a CUDA GPU (CUDA graphs); use --compile, or no --compile, on the CPU")
    try:
        ckpt_path = find_checkpoint(args.run, args.runs_root)
        model, tokenizer, ckpt = load_model(ckpt_path, device, args.attn)
    except (CheckpointError, ValueError) as e:  # ValueError: e.g. an --attn without the model's attn_softcap
        print(f"error: {e}", file=sys.stderr)
        return 1
    backend = REGISTRY[model.config.attn]
    if device == "cpu" and args.compile and not backend.compiles_on_cpu:
        print(f"error: --compile: torch.compile cannot lower attn={backend.name} on the CPU; run without --compile"
              + ("" if model.config.attn_softcap else ", or with --attn sdpa"), file=sys.stderr)
        return 1
    print(f"# {ckpt_path}" + (f" (step {ckpt['step']})" if ckpt.get("step") is not None else ""), file=sys.stderr)
    if args.kv_cache is None:
        args.kv_cache = not model.config.windowed
        if model.config.windowed:
            print(f"# model.attn_window={model.config.attn_window}: generating without the KV cache, which has no "
                  "sliding window", file=sys.stderr)
    parts = memory_needed(model, args.num_samples, 1 + args.num_tokens, args.kv_cache)  # a prompt has >= 1 token
    memory = device_memory(torch.device(device))
    if memory and sum(parts.values()) > memory:
        gib = lambda n: f"{n / 2**30:,.1f} GiB"
        print(f"error: --num-samples={args.num_samples}: generating needs at least {gib(sum(parts.values()))} on "
              f"{device} ({', '.join(f'{name} {gib(n)}' for name, n in parts.items())}) and it has {gib(memory)}; "
              "choose a smaller --num-samples" + (" (or --no-kv-cache)" if args.kv_cache else ""), file=sys.stderr)
        return 1
    try:
        texts = sample(model, tokenizer, args.prompt, args.num_tokens, args.temperature, args.top_k or None,
                       args.num_samples, args.seed, args.kv_cache, args.compile, args.cuda_graph)
    except ValueError as e:  # e.g. a prompt character outside the char vocabulary
        print(f"error: {e}", file=sys.stderr)
        return 1
    for i, text in enumerate(texts):
        if i:
            print("\n" + "-" * 40)
        print(args.prompt + text)
    return 0


if __name__ == "__main__":
    warnings.showwarning = show_warning  # the command line, not an imported library
    sys.exit(main())
