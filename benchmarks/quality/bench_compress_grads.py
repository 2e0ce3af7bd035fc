"""The gradient error of compressed residuals on a real pretrained model (issue 34, section 3
"Gradient error"): SmolLM2-135M-Instruct (``smollm2.py``), float32, at its pretrained
weights and one real text batch (2 rows of T=256 from the Shakespeare excerpt jaxckpt ships,
tokenized with the model's tokenizer).

For each remat preset (``full``, ``save_attn``, ``minimal``, ``offload_full`` where the
device has ``pinned_host`` memory, ``ratio_0.5``) the gradient of the mean next-token loss
is taken uncompressed, then with ``remat.compressed(preset, fmt)`` for ``fmt`` in int8 and
fp8: every compressible kept tag together (``all``), and each of them alone. Each compressed
gradient is compared with the uncompressed one of its preset:

* per parameter: ``|g_c - g| / |g|`` (relative L2) and the cosine of ``g_c`` and ``g``, a
  parameter being one tensor of the checkpoint (a stacked layer weight counts once per
  layer: ``layers.7.attn.q_proj.kernel``; 273 of them);
* globally: the same over every parameter's gradient flattened together;
* the worst parameter: the one of largest relative error (its cosine beside it).

For scale, the same comparison between the uncompressed gradients of two different batches
(``batch_noise``: the noise every step of training has anyway), and each layer input's own
round-trip error (``layer_input_roundtrip``).

The forward pass is exact, so the losses are equal (checked: bit for bit); a run in which
every compressed gradient equals its uncompressed one exits 1 (the compression did not act).

    python benchmarks/quality/bench_compress_grads.py               # every preset (~35 compiles)
    python benchmarks/quality/bench_compress_grads.py --presets full minimal --formats int8
    python benchmarks/quality/bench_compress_grads.py --summary     # the table from the JSON

Writes ``results/compress_grads.json`` (after every preset, so an interrupted run keeps what
it measured; ``--resume`` skips the presets already there) and prints the table.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # smollm2
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import jax
import jax.numpy as jnp
import numpy as np
import smollm2
from flax import nnx
from harness import RESULTS, table, write_json
from rich.console import Console

from jaxckpt import remat, train

PRESETS = ("full", "save_attn", "minimal", "offload_full", "ratio_0.5")
FORMATS = ("int8", "fp8")
ALL = "all"
"""The row of every compressible tag the preset keeps, compressed together."""


def has_pinned_host() -> bool:
    return any(m.kind == "pinned_host" for m in jax.devices()[0].addressable_memories())


def param_names(params, n_layers: int) -> tuple[list[str], list[tuple[int, int | None]]]:
    """The checkpoint-tensor names of the flattened leaves of ``params`` and, for each
    name, ``(leaf index, layer or None)``: a stacked block weight is one tensor a layer."""
    names, where = [], []
    for i, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(params)):
        keys = [getattr(k, "key", getattr(k, "name", str(k))) for k in path]
        keys = [str(k) for k in keys if str(k) != "value"]
        if keys[0] == "blocks" and leaf.shape[:1] == (n_layers,):
            for layer in range(n_layers):
                names.append(".".join(["layers", str(layer), *keys[1:]]))
                where.append((i, layer))
        else:
            names.append(".".join(keys))
            where.append((i, None))
    return names, where


def gradient_fn(model, spec):
    """``tokens -> (loss, grads)``, jitted, grads as a list of float32 numpy leaves."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params, tokens):
        def loss(p):
            return train.next_token_loss(nnx.merge(graphdef, p, rest), tokens, remat=spec)

        return jax.value_and_grad(loss)(params)

    def call(tokens):
        loss, grads = run(params, tokens)
        return float(loss), [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]

    return call


def compare(ref: list[np.ndarray], got: list[np.ndarray], where) -> dict:
    """Relative L2 error and cosine, per checkpoint tensor and over all of them."""
    rel, cos = [], []
    dot = nref = ngot = nerr = 0.0
    for i, layer in where:
        a = ref[i] if layer is None else ref[i][layer]
        b = got[i] if layer is None else got[i][layer]
        a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        d = float(a @ b)
        na, nb, ne = float(a @ a), float(b @ b), float((b - a) @ (b - a))
        rel.append(np.sqrt(ne / na) if na > 0 else (0.0 if ne == 0 else np.inf))
        cos.append(d / np.sqrt(na * nb) if na > 0 and nb > 0 else 1.0)
        dot, nref, ngot, nerr = dot + d, nref + na, ngot + nb, nerr + ne
    worst = int(np.argmax(rel))
    return {
        "global_rel": float(np.sqrt(nerr / nref)),
        "global_cos": float(dot / np.sqrt(nref * ngot)),
        "worst": worst,
        "worst_rel": float(rel[worst]),
        "worst_cos": float(cos[worst]),
        "min_cos": float(min(cos)),
        "rel": [float(r) for r in rel],
        "cos": [float(c) for c in cos],
    }


def roundtrip(hidden: list[np.ndarray], weights: list[np.ndarray], eps: float, formats) -> dict:
    """Why the layer input is the hard tag: per layer, the relative L2 error of its own
    round trip through each format (group 128), and of the attention norm's output computed
    from it (what the layer's projections read), with its largest |value| and its RMS. A few
    feature channels of a pretrained model's residual stream hold values hundreds of times
    the others' and set their group's scale: the L2 error of the input, which those channels
    dominate, stays small, while the normed values of the other channels, which the norm's
    weight scales up, lose their low bits."""

    def normed(x, w):
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w

    out = {
        "absmax": [float(np.abs(h).max()) for h in hidden],
        "rms": [float(np.sqrt((h**2).mean())) for h in hidden],
    }
    for fmt in formats:
        errs, norm_errs = [], []
        for h, w in zip(hidden, weights, strict=True):
            back = np.asarray(remat.dequantize(remat.quantize(jnp.asarray(h), fmt)))
            errs.append(float(np.linalg.norm(back - h) / np.linalg.norm(h)))
            a, b = normed(h, w), normed(back, w)
            norm_errs.append(float(np.linalg.norm(b - a) / np.linalg.norm(a)))
        out[fmt] = errs
        out[f"{fmt}_normed"] = norm_errs
    return out


def configs(preset: str, fmt: str) -> list[tuple[str, object]]:
    """``(tags, spec)``: every compressible kept tag, then each alone (when there are several)."""
    every = remat.compressed(preset, fmt)
    tags = sorted(str(t) for t in every.compress)
    rows = [(ALL, every)]
    if len(tags) > 1:
        rows += [(t, remat.compressed(preset, fmt, tags=[t])) for t in tags]
    return rows


def measure(args, log) -> dict:
    path = smollm2.hf_checkpoint(log)
    model = smollm2.load_model(path)
    logits = smollm2.logits_check(model, path)
    log(
        f"logits vs transformers on {logits['tokens']} tokens: max abs diff {logits['max_abs_diff']:.2e} "
        f"(largest logit {logits['max_abs_logit']:.1f}, same argmax: {logits['same_argmax']})"
    )
    train_tokens, _ = smollm2.corpus_tokens(path)
    tokens = jnp.asarray(smollm2.random_windows(train_tokens, np.random.default_rng(0), args.batch, args.seq))
    inputs = roundtrip(*smollm2.layer_inputs(np.asarray(tokens[:, :-1]), path), args.formats)
    peak = max(a / r for a, r in zip(inputs["absmax"], inputs["rms"], strict=True))
    log(
        "layer inputs' own round trip, relative L2 over layers (min / max): "
        + ", ".join(f"{f} {min(inputs[f]):.1e} / {max(inputs[f]):.1e}" for f in args.formats)
        + "; of the normed input: "
        + ", ".join(
            f"{f} {min(inputs[f + '_normed']):.1e} / {max(inputs[f + '_normed']):.1e}" for f in args.formats
        )
        + f"; largest |value| / RMS up to {peak:.0f}"
    )
    _, params, _ = nnx.split(model, nnx.Param, ...)
    names, where = param_names(params, model.config.n_layers)
    out = args.out / "compress_grads.json"
    result = json.loads(out.read_text()) if args.resume and out.is_file() else {"rows": []}
    result.update(
        {
            "model": smollm2.MODEL_NAME,
            "source": f"{smollm2.GGUF_PACKAGE}/{smollm2.GGUF_FILE}",
            "dtype": model.config.dtype,
            "batch": args.batch,
            "seq": args.seq,
            "text": "jaxckpt/train/data/shakespeare.txt, 2 random windows (numpy seed 0) of its first 90%",
            "compiler": "XLA:CPU",
            "machine": platform.machine(),
            "jax": jax.__version__,
            "logits_check": logits,
            "layer_input_roundtrip": inputs,
            "params": names,
        }
    )
    done = {r["preset"] for r in result["rows"]}
    for preset in args.presets:
        if preset in done:
            log(f"{preset}: in the JSON already (--resume)")
            continue
        if preset.startswith("offload") and not has_pinned_host():
            log(f"{preset}: skipped, the device has no pinned_host memory")
            continue
        t0 = time.perf_counter()
        ref_loss, ref = gradient_fn(model, remat.get(preset))(tokens)
        rows = []
        for fmt in args.formats:
            for tags, spec in configs(preset, fmt):
                loss, got = gradient_fn(model, spec)(tokens)
                row = {"preset": preset, "format": fmt, "tags": tags, "loss_equal": loss == ref_loss}
                row.update(compare(ref, got, where))
                rows.append(row)
                log(
                    f"{preset} {fmt} {tags}: global rel {row['global_rel']:.2e} cos {row['global_cos']:.6f}, "
                    f"worst {names[row['worst']]} rel {row['worst_rel']:.2e}"
                    + ("" if row["loss_equal"] else f"  LOSS DIFFERS {loss} vs {ref_loss}")
                )
        result["rows"] = [r for r in result["rows"] if r["preset"] != preset] + rows
        result.setdefault("loss", {})[preset] = ref_loss
        write_json(out, result)
        log(f"{preset}: {len(rows)} compressed gradients in {time.perf_counter() - t0:.0f} s")
    if "batch_noise" not in result:
        # The scale of a step's own noise: the same comparison between two batches' gradients.
        other = jnp.asarray(
            smollm2.random_windows(train_tokens, np.random.default_rng(1), args.batch, args.seq)
        )
        grads = gradient_fn(model, remat.get("full"))
        noise = compare(grads(tokens)[1], grads(other)[1], where)
        result["batch_noise"] = {k: noise[k] for k in ("global_rel", "global_cos", "rel", "cos")}
        log(
            f"another batch's gradient (uncompressed): global rel {noise['global_rel']:.2e} "
            f"cos {noise['global_cos']:.4f}"
        )
        write_json(out, result)
    return result


def print_table(console, result: dict) -> None:
    names = result["params"]
    t = table(
        f"gradient error, compressed vs uncompressed: SmolLM2-135M ({result['dtype']}), "
        f"B={result['batch']} T={result['seq']}, {result['compiler']}",
        "preset / format / tags",
        ["global rel L2", "global cos", "worst parameter", "its rel L2", "its cos", "loss equal"],
    )
    for r in result["rows"]:
        t.add_row(
            f"{r['preset']} / {r['format']} / {r['tags']}",
            f"{r['global_rel']:.2e}",
            f"{r['global_cos']:.6f}",
            names[r["worst"]] if r["worst_rel"] > 0 else "(none: every error is 0)",
            f"{r['worst_rel']:.2e}",
            f"{r['worst_cos']:.6f}",
            "yes" if r["loss_equal"] else "NO",
        )
    console.print(t)
    noise = result.get("batch_noise")
    if noise:
        console.print(
            f"for scale, two batches' uncompressed gradients ('full'): global rel {noise['global_rel']:.2e} "
            f"cos {noise['global_cos']:.4f}",
            highlight=False,
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--out", type=Path, default=RESULTS, help="the folder of the JSON result")
    p.add_argument("--resume", action="store_true", help="skip the presets the JSON has")
    p.add_argument("--summary", action="store_true", help="print the table from the JSON and exit")
    args = p.parse_args(argv)
    console = Console(width=200)
    log = lambda s: console.print(s, highlight=False)
    if args.summary:
        print_table(console, json.loads((args.out / "compress_grads.json").read_text()))
        return 0
    result = measure(args, log)
    print_table(console, result)
    if result["rows"] and all(r["global_rel"] == 0 for r in result["rows"]):
        log("every compressed gradient equals the uncompressed one: the compression did not act")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
