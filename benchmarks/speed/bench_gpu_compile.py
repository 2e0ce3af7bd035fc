"""Attention for an H100 without one: every implementation compiled by XLA:GPU, deviceless.

``jaxckpt.flash_attention`` with ``implementation="blockwise"``, ``"pallas"`` (Triton),
``"xla"`` (jax.nn) and ``"cudnn"`` is compiled, forward and forward+backward (the gradient wrt q, k, v of
``sum(out * w)``), for the ``h100-80g`` target (sm_90a) under
``jaxckpt.attention.compiling_for("gpu")``, in bf16 and fp16, for each feature: causal,
a window ``(left, right)``, causal + a window ``(left, 0)``, GQA and sequence lengths.
A combination an implementation refuses is reported with its error message. Three
tables:

1. structure: the compiled HLO's while loops, conditionals, fusions (gemm fusions apart)
   and custom calls by target, the temp bytes, and the largest array;
2. memory: temp bytes of each implementation against cuDNN at T = 2048 and 8192
   (B=1, N=8, K=8 or 2, H=128, bf16, causal, fwd+bwd), as a ratio plus the bytes;
3. dispatch: which implementation ``implementation=None`` picks for each feature set
   when compiling for the GPU (found by comparing its lowered program with each
   explicit implementation's), and what explicit cuDNN says to the call.

How the structure is counted (``hlo_structure``): the text of ``compiled.as_text()`` is
split into computations; those that a ``fusion`` instruction ``calls=`` are fused bodies
(one kernel each, nested fusions inside them included) and are skipped. In every other
computation (ENTRY, while bodies and conditions, conditional branches) each instruction
``%name = <shape> opcode(...)`` is counted by opcode: ``while``, ``conditional``,
``fusion`` (grouped by ``kind=``; a ``kCustom`` fusion by its backend kind, e.g.
``__triton_nested_gemm_fusion`` (a GEMM; "gemm" in the table), ``__triton`` (a softmax),
or its custom fusion's name, e.g. ``dynamic_slice_fusion``) and ``custom-call`` (grouped by
``custom_call_target``, e.g. ``__cudnn$fmhaSoftmax``, ``__cublas$gemm``; a Triton kernel,
``__gpu$xla.gpu.triton``, by its ``pallas_call`` name: ``fwd``, ``bwd_delta``, ...). "B*N*T*S" marks
a program holding an array of at least B*N*T*S elements, the whole scores (one blockwise
tile when T fits a block).

Every figure is from XLA:GPU compiling without a GPU: no autotuning (GEMM tiles are
XLA's defaults), and cuDNN's workspace is left at ``u8[0]``, so it is missing from temp.

    JAX_PLATFORMS=cpu python benchmarks/speed/bench_gpu_compile.py           # the full grid
    JAX_PLATFORMS=cpu python benchmarks/speed/bench_gpu_compile.py --quick   # T=256 bf16, T=2048
"""

import argparse
import collections
import dataclasses
import math
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import jax
import jax.numpy as jnp
from harness import RESULTS, write_json
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.table import Table

import jaxckpt
from jaxckpt import plan

TARGET = "h100-80g"
IMPLEMENTATIONS = ("blockwise", "pallas", "xla", "cudnn")
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
MIB = 2**20
REFUSALS = (ValueError, TypeError, NotImplementedError)


@dataclasses.dataclass(frozen=True)
class Dims:
    """B, T (= S), N query heads, K key/value heads, H head dim."""

    b: int = 1
    t: int = 1024
    n: int = 8
    k: int = 8
    h: int = 128


@dataclasses.dataclass(frozen=True)
class Case:
    """One feature set: static ``flash_attention`` keywords plus the array arguments it takes.

    ``arrays`` names keyword arguments given as inputs: ``lengths`` (both seq lengths),
    ``bias``, ``mask`` and ``segments``.
    """

    name: str
    kwargs: dict = dataclasses.field(default_factory=dict)
    arrays: tuple = ()
    gqa: bool = False


def feature_cases(t: int) -> list[Case]:
    """The features of the structure grid, with a window of T/8 to the left."""
    w = t // 8
    return [
        Case("causal", {"is_causal": True}),
        Case(f"window ({w},{w // 2})", {"local_window_size": (w, w // 2)}),
        Case(f"causal+window ({w},0)", {"is_causal": True, "local_window_size": (w, 0)}),
        Case("GQA causal", {"is_causal": True}, gqa=True),
        Case("lengths", arrays=("lengths",)),
    ]


def _abstract(dims: Dims, dtype, case: Case, sharding) -> tuple[list, list[str]]:
    """The abstract inputs (q, k, v, w, *arrays) and the names of the array keywords."""
    b, t, n, h = dims.b, dims.t, dims.n, dims.h
    k = max(1, n // 4) if case.gqa else dims.k

    def sd(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    q, kv = sd((b, t, n, h), dtype), sd((b, t, k, h), dtype)
    args, names = [q, kv, kv, q], []
    specs = {
        "lengths": [("query_seq_lengths", (b,), jnp.int32), ("key_value_seq_lengths", (b,), jnp.int32)],
        "bias": [("bias", (1, n, t, t), dtype)],
        "mask": [("mask", (1, 1, t, t), jnp.bool_)],
        "segments": [("segment_ids", (b, t), jnp.int32)],
    }
    for array in case.arrays:
        for name, shape, dt in specs[array]:
            args.append(sd(shape, dt))
            names.append(name)
    return args, names


def _function(impl: str | None, case: Case, names: list[str], grad: bool):
    kwargs = dict(case.kwargs)
    if kwargs.pop("dropout", False):
        kwargs.update(dropout_rate=0.1, dropout_rng=jax.random.key(0))

    def attend(q, k, v, w, *arrays):
        out = jaxckpt.flash_attention(
            q, k, v, implementation=impl, **kwargs, **dict(zip(names, arrays, strict=True))
        )
        return jnp.sum((out * w).astype(jnp.float32)) if grad else out

    return jax.jit(jax.grad(attend, argnums=(0, 1, 2)) if grad else attend)


def lower(impl, case: Case, dims: Dims, dtype, sharding, grad: bool):
    """``jit(...).lower`` of one call under ``compiling_for("gpu")``."""
    args, names = _abstract(dims, dtype, case, sharding)
    with plan.deviceless():
        return _function(impl, case, names, grad).lower(*args)


_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"\b(pred|bf16|[fsu]\d+|f8\w*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2}


def _computations(text: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            name = header.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    return comps


def _array_bytes(dtype: str, dims: str) -> int:
    size = _BYTES.get(dtype) or max(1, int(re.sub(r"\D", "", dtype) or 8) // 8)
    for d in filter(None, dims.split(",")):
        size *= int(d)
    return size


def hlo_structure(text: str, scores: int) -> dict:
    """Counts of the compiled module's unfused instructions by opcode (see the module doc)."""
    comps = _computations(text)
    fused = set(re.findall(r"\bfusion\(.*?calls=%?([\w.\-]+)", text))
    counts, fusions, calls = collections.Counter(), collections.Counter(), collections.Counter()
    largest, holds_scores = (0, ""), False
    for name, lines in comps.items():
        if name in fused:
            continue
        for line in lines:
            m = _INSTRUCTION.match(line)
            if m is None:
                continue
            shape, opcode, rest = m.groups()
            counts[opcode] += 1
            if opcode == "fusion":
                kind = re.search(r"kind=(\w+)", rest).group(1)
                backend = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', rest)
                named = re.search(r'"custom_fusion_config":\{"name":"([^"]+)"', rest)
                fusions[(named or backend).group(1) if kind == "kCustom" and backend else kind] += 1
            elif opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', rest).group(1)
                kernel = re.search(r'name = \\?"([^"\\]+)', rest)  # a Triton kernel's name
                calls[kernel.group(1) if target.endswith("triton") and kernel else target] += 1
            for dtype, dims in _ARRAY.findall(shape):
                largest = max(largest, (_array_bytes(dtype, dims), f"{dtype}[{dims}]"))
                holds_scores |= math.prod(int(d) for d in filter(None, dims.split(","))) >= scores
    return {
        "while": counts["while"],
        "conditional": counts["conditional"],
        "fusions": counts["fusion"],
        "fusion_kinds": dict(sorted(fusions.items())),
        "custom_calls": dict(sorted(calls.items())),
        "largest_array": largest[1],
        "largest_array_bytes": largest[0],
        "holds_scores": holds_scores,
    }


def compile_case(impl, case: Case, dims: Dims, dtype, sharding, grad: bool) -> dict:
    """Compiles one call; a refusal (at trace time) or a compiler error is recorded, not raised."""
    row = {"implementation": impl, "feature": case.name, "dtype": jnp.dtype(dtype).name}
    row |= {"pass": "fwd+bwd" if grad else "fwd", **dataclasses.asdict(dims)}
    if case.gqa:
        row["k"] = max(1, dims.n // 4)
    start = time.perf_counter()
    try:
        lowered = lower(impl, case, dims, dtype, sharding, grad)
    except REFUSALS as err:
        return row | {"status": "refused", "error": f"{type(err).__name__}: {err}"}
    try:
        compiled = lowered.compile()
    except Exception as err:  # the compiler's failure is the result
        return row | {"status": "failed", "error": f"{type(err).__name__}: {err}"}
    row["compile_s"] = time.perf_counter() - start
    row["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
    return row | {"status": "ok", **hlo_structure(compiled.as_text(), dims.b * dims.n * dims.t**2)}


def _short(target: str) -> str:
    return target.removeprefix("__cudnn$").removeprefix("__cublas$").removeprefix("jaxckpt_flash_")


def structure_table(rows: list[dict], dims: Dims) -> Table:
    title = f"compiled structure, {TARGET} (B={dims.b} T=S={dims.t} N={dims.n} K={dims.k} H={dims.h})"
    table = Table(title=title)
    cols = ("impl", "dtype", "feature", "pass", "status", "while", "cond", "fusions (gemm)")
    for col in (*cols, "custom calls", "temp MiB", "largest array", "B*N*T*S"):
        table.add_column(
            col, justify="left" if col in (*cols[:5], "custom calls", "largest array") else "right"
        )
    for r in rows:
        head = (r["implementation"], r["dtype"], r["feature"], r["pass"], r["status"])
        if r["status"] != "ok":
            table.add_row(*head, *("-",) * 7)
            continue
        gemm = sum(n for kind, n in r["fusion_kinds"].items() if "gemm" in kind)
        calls = " ".join(f"{_short(t)}x{n}" for t, n in r["custom_calls"].items()) or "-"
        table.add_row(
            *head,
            str(r["while"]),
            str(r["conditional"]),
            f"{r['fusions']} ({gemm})",
            calls,
            f"{r['temp_bytes'] / MIB:.2f}",
            r["largest_array"],
            "yes" if r["holds_scores"] else "no",
        )
    return table


def memory_rows(seqs, sharding) -> list[dict]:
    """Temp bytes of each implementation at each T, MHA and GQA, with the ratio to cuDNN."""
    rows = []
    for t in seqs:
        for gqa in (False, True):
            case = Case("GQA causal" if gqa else "causal", {"is_causal": True}, gqa=gqa)
            group = [compile_case(i, case, Dims(t=t), jnp.bfloat16, sharding, True) for i in IMPLEMENTATIONS]
            cudnn = next((r.get("temp_bytes") for r in group if r["implementation"] == "cudnn"), None)
            for r in group:
                temp = r.get("temp_bytes")
                r["ratio_to_cudnn"] = temp / cudnn if temp is not None and cudnn else None
            rows += group
    return rows


def memory_table(rows: list[dict]) -> Table:
    table = Table(title=f"fwd+bwd temp memory vs cuDNN, {TARGET}, B=1 N=8 H=128 bf16 causal")
    for col in ("T", "K", "impl", "temp bytes", "temp MiB", "x cuDNN", "largest array"):
        table.add_column(col, justify="left" if col in ("impl", "largest array") else "right")
    for r in rows:
        ok = r["status"] == "ok"
        table.add_row(
            str(r["t"]),
            str(r["k"]),
            r["implementation"],
            f"{r['temp_bytes']:,}" if ok else r["status"],
            f"{r['temp_bytes'] / MIB:.1f}" if ok else "-",
            f"{r['ratio_to_cudnn']:.2f}" if r["ratio_to_cudnn"] is not None else "-",
            r.get("largest_array", "-"),
        )
    return table


_CAUSAL = {"is_causal": True}
_SIZES = (("bf16", 128), ("fp16", 128), ("fp32", 128), ("bf16", 64), ("bf16", 256), ("bf16", 100))
DISPATCH_CASES = (  # (dtype, H, Case)
    *((dtype, h, Case("causal", _CAUSAL)) for dtype, h in _SIZES),
    *(
        ("bf16", 128, case)
        for case in (
            Case("none"),
            Case("window (32,16)", {"local_window_size": (32, 16)}),
            Case("window (32,0)", {"local_window_size": (32, 0)}),
            Case("causal+window (32,16)", {**_CAUSAL, "local_window_size": (32, 16)}),
            Case("causal+window (32,16)+lengths", {**_CAUSAL, "local_window_size": (32, 16)}, ("lengths",)),
            Case("GQA causal", _CAUSAL, gqa=True),
            Case("lengths", arrays=("lengths",)),
            Case("bias", arrays=("bias",)),
            Case("mask", arrays=("mask",)),
            Case("segments", arrays=("segments",)),
            Case("softcap", {"logits_soft_cap": 30.0}),
            Case("dropout", {"dropout": True}),
        )
    ),
)


def dispatch_rows(sharding) -> list[dict]:
    """``implementation=None``'s pick: the explicit implementation whose lowered program equals it."""
    rows = []
    for dtype_name, h, case in DISPATCH_CASES:
        dims, dtype = Dims(t=256, h=h), DTYPES[dtype_name]
        row = {"dtype": dtype_name, "h": h, "feature": case.name, "picked": "?", "cudnn": "accepts"}
        try:
            auto = lower(None, case, dims, dtype, sharding, grad=True).as_text()
        except REFUSALS as err:
            row["picked"], auto = f"raises {type(err).__name__}", None
        for impl in IMPLEMENTATIONS:
            try:
                text = lower(impl, case, dims, dtype, sharding, grad=True).as_text()
            except REFUSALS as err:
                if impl == "cudnn":
                    row["cudnn"] = f"{type(err).__name__}: {err}"
                continue
            if text == auto:
                row["picked"] = impl
        rows.append(row)
    return rows


def dispatch_table(rows: list[dict]) -> Table:
    table = Table(title='implementation=None under compiling_for("gpu") (T=S=256, N=K=8; GQA K=2)')
    for col in ("dtype", "H", "features", "picks", "explicit cudnn says"):
        table.add_column(col, justify="right" if col == "H" else "left")
    for r in rows:
        table.add_row(r["dtype"], str(r["h"]), r["feature"], r["picked"], r["cudnn"])
    return table


def _refusals(console: Console, rows: list[dict]) -> None:
    seen = {}
    for r in rows:
        if r["status"] != "ok":
            seen.setdefault(r["error"], []).append(f"{r['implementation']} {r['dtype']} {r['feature']}")
    for error, where in seen.items():
        console.print(
            f"[bold]refused/failed[/bold] ({len(where)}: {', '.join(sorted(set(where)))}):\n  {error}"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="structure at T=256 in bf16; memory at T=2048")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_compile.json")
    args = parser.parse_args(argv)
    plan.quiet_plugins_without_devices()
    console = Console(width=200)
    reason = plan.gpu_aot_unavailable()
    if reason is not None:
        console.print(f"cannot compile for {TARGET}: {reason}")
        return 2
    sharding = NamedSharding(Mesh(plan.target_devices(TARGET), ("x",)), P())
    dims = Dims(t=256) if args.quick else Dims()
    dtypes = ("bf16",) if args.quick else ("bf16", "fp16")
    console.print(
        f"XLA:GPU, deviceless, {TARGET} ({plan.TARGETS[TARGET].sm}), not autotuned: {plan.AUTOTUNE_CAVEAT}."
    )
    console.print(
        "cuDNN's workspace is left at u8[0] by a deviceless compile: it is missing from cuDNN's temp."
    )
    structure = []
    for impl in IMPLEMENTATIONS:
        for dtype in dtypes:
            for case in feature_cases(dims.t):
                with console.status(f"{impl} {dtype} {case.name} ..."):
                    for grad in (False, True):
                        structure.append(compile_case(impl, case, dims, DTYPES[dtype], sharding, grad))
    console.print(structure_table(structure, dims))
    _refusals(console, structure)
    with console.status("memory ..."):
        memory = memory_rows((2048,) if args.quick else (2048, 8192), sharding)
    console.print(memory_table(memory))
    with console.status("dispatch ..."):
        dispatch = dispatch_rows(sharding)
    console.print(dispatch_table(dispatch))
    payload = {
        "measured_on": plan.TARGETS[TARGET].measured_on,
        "compiler": "XLA:GPU, deviceless ahead-of-time (no GPU), not autotuned",
        "caveat": plan.AUTOTUNE_CAVEAT,
        "jax": jax.__version__,
        "quick": args.quick,
        "structure": structure,
        "memory": memory,
        "dispatch": dispatch,
    }
    console.print(f"wrote {write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
