#!/usr/bin/env bash
# Compile both Gluon FA3 kernels and the packed-sequence schedule's Triton kernels for sm_90 (no GPU needed) on
# each Triton release, each in a throwaway venv that sees this machine's torch (--system-site-packages) and
# installs only `triton==VERSION`.
#   bash tools/check_triton_versions.sh               # 3.6.0 3.7.1 3.8.0 3.9.0
#   bash tools/check_triton_versions.sh 3.9.0 3.10.0  # any releases
# Prints one line per release and kernel: how many of its variants compiled (the dense ones, then sliding window,
# packed documents, softcap and GQA, then the narrow-window and packed-document configs and the backward's
# short-key one; the largest shared memory), then the schedule's kernels, or the reason it falls back to FA2. A
# warning Triton gives while compiling is printed as is.
set -u
for arg in "$@"; do
  case $arg in
    -h|--help) sed -n '2,10p' "$0" | cut -c3-; exit 0 ;;
    [0-9]*.[0-9]*) ;;
    *) echo "check_triton_versions.sh: $arg: expected Triton release numbers such as 3.9.0 (or --help)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
versions=${*:-3.6.0 3.7.1 3.8.0 3.9.0}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
for version in $versions; do
  venv=$root/$version
  if ! { python3 -m venv --system-site-packages "$venv" && "$venv/bin/pip" install -q "triton==$version"; } >"$root/log" 2>&1; then
    echo "triton $version: not installed ($(tail -n 1 "$root/log"))"; continue
  fi
  env -u TRITON_INTERPRET "$venv/bin/python" - "$version" <<'PY' 2>&1 | grep -v "nanobind\|leaked\|skipped remainder\|refleaks"
import itertools, sys
import torch
from kernels import fa3
version = sys.argv[1]
kernels = fa3.gluon_kernels()
if isinstance(kernels, str):
    print(f"triton {version}: falls back to FA2: {kernels}")
    sys.exit()
variants = [dict(head_dim=d, causal=c, dtype=t) for d, c, t in
            itertools.product(fa3.HEAD_DIMS, (True, False), (torch.bfloat16, torch.float16))]
variants += [dict(head_dim=d, causal=True, dtype=torch.bfloat16, **extra) for d in fa3.HEAD_DIMS for extra in
             (dict(window=True), dict(docs=True), dict(softcap=True), dict(group=4))]
# the other configs where the dispatch takes them: short keys, narrow windows, packed documents
bf16 = dict(causal=True, dtype=torch.bfloat16)
other = {"bwd": [dict(head_dim=d, causal=c, dtype=torch.bfloat16, config=config, **extra)
                 for d, config in fa3.SHORT_BACKWARD_CONFIGS.items()
                 for c, extra in ((True, {}), (False, {}), (True, dict(softcap=True)), (True, dict(group=4)))]}
other["bwd"] += [dict(head_dim=d, config=config, window=True, **bf16)
                 for d, config in fa3.NARROW_WINDOW_BACKWARD_CONFIGS.items()]
other["bwd"] += [dict(head_dim=d, config=config, docs=True, **bf16) for d, config in fa3.PACKED_BACKWARD_CONFIGS.items()]
other["fwd"] = [dict(head_dim=d, config=config, window=True, **bf16)
                for d, config in fa3.NARROW_WINDOW_FORWARD_CONFIGS.items()]
other["fwd"] += [dict(head_dim=d, config=config, docs=True, **bf16) for d, config in fa3.PACKED_FORWARD_CONFIGS.items()]
for kernel in ("fwd", "bwd"):
    ok, failed, shared = 0, 0, 0
    head_dims = fa3.HEAD_DIMS if kernel == "fwd" else fa3.BACKWARD_HEAD_DIMS
    for v in [v for v in variants if v["head_dim"] in head_dims] + other[kernel]:
        try:
            compiled = fa3.compile_for_sm90(kernel=kernel, **v)
        except Exception as e:
            print(f"triton {version} {kernel} {v}: FAILED {type(e).__name__}: {str(e)[:200]}")
            failed += 1
            continue
        ok, shared = ok + 1, max(shared, compiled.metadata.shared)
    print(f"triton {version} {kernel}: {ok} of {ok + failed} compiled for sm_90 (head_dim "
          f"{'/'.join(map(str, head_dims))}, causal or not, "
          f"bf16/fp16; window, documents, softcap, GQA 4; the {'short, ' if kernel == 'bwd' else ''}narrow-window "
          "and packed-document configs; "
          f"max shared memory {shared} B)")
from kernels import fa3_schedule
ok = []
for args in (("bounds",), ("order", 16, True), ("order", fa3_schedule.SORT_MAX, False)):
    try:
        fa3_schedule.compile_for_sm90(*args)
        ok.append(args)
    except Exception as e:
        print(f"triton {version} schedule {args}: FAILED {type(e).__name__}: {str(e)[:200]}")
print(f"triton {version} packed-sequence schedule: {len(ok)} of 3 compiled for sm_90 (bounds; the sort at 16 "
      f"and {fa3_schedule.SORT_MAX} keys)")
PY
done
