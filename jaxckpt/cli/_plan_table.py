"""How ``jaxckpt plan`` prints its answer: the rows as a table, the chosen spec and the
specs compiled, each figure labelled with the compiler that measured it."""

from rich import box
from rich.table import Table

from jaxckpt import plan

_SIZE_COLUMNS = (
    ("params", "params_bytes"),
    ("grads", "grads_bytes"),
    ("optimizer", "optimizer_bytes"),
    ("activations", "activation_bytes"),
    ("total", "total_bytes"),
)


def compiler_label(measured_on: str) -> str:
    """``"xla-cpu"`` -> ``"XLA:CPU"``; ``"xla-gpu:h100-80g"`` -> ``"XLA:GPU h100-80g"``."""
    kind, _, target = measured_on.partition(":")
    return kind.upper().replace("-", ":") + (f" {target}" if target else "")


def table(result: dict) -> Table:
    """The rows as a rich table; the chosen one starred, with XLA's measured peak."""
    c, rows = result["config"], result["rows"]
    micro = f" x{c['micro_batches']} micro-batches" if c["micro_batches"] > 1 else ""
    title = f"{result['model']} B={c['batch']} T={c['seq']}{micro}, {c['optimizer']}"
    if c["moments_dtype"]:
        title += f" ({c['moments_dtype']} moments)"
    if c["optimizer_placement"] == "host":
        title += " (state in host memory)"
    title += f", {c['param_dtype']} params, {c['dtype']} compute"
    if c["lora"] is not None:
        lora = c["lora"]
        kind = f"QLoRA {c['quantize_base']}" if c["quantize_base"] else "LoRA"
        title += f", {kind} r={lora['rank']} on {','.join(lora['targets'])}"
    if c["devices"] > 1:
        title += f"; per device, FSDP over {c['devices']} devices (B={c['batch'] // c['devices']} each)"
    budget = plan.format_bytes(result["budget_bytes"])
    if result["device"]:
        budget += f" ({result['device']}, {result['budget_bytes'] / 1e9:g} GB)"
    if result["headroom"]:
        budget += f" less {result['headroom']:.0%} headroom"
    source = "predicted" if result["minimum_source"] == "predicted" else "measured by XLA"
    on_gpu = result["measured_on"] != "xla-cpu"
    devices_kind = f"{result['measured_on'].partition(':')[2]} devices" if on_gpu else "simulated CPU devices"
    notes = [
        *result.get("notes", []),
        f"budget {budget}; smallest peak {plan.format_bytes(result['minimum_bytes'])} ({source})",
        "sizes and fits are predicted from shapes, but the chosen row's fit, which XLA measured; "
        "recompute: extra FLOPs as a share of a step's",
        *(
            [f"measured: the FSDP step compiled over {c['devices']} {devices_kind}, one device's peak"]
            if c["devices"] > 1
            else []
        ),
    ]
    if any(r["activation_bytes"] == r["params_bytes"] for r in rows):
        notes.append("activations equal to params are the floor: the update reuses their buffers")
    if result["offload_rows"] != "shown":
        notes.append(f"offload presets {result['offload_rows']}")
    notes += compression_notes(result.get("compression") or {})
    if c["optimizer_placement"] == "host":
        notes.append(
            "the optimizer state is in host memory: left out of the device's sizes (on CPU it is the "
            "same RAM and saves nothing), its traffic priced at the host link"
        )
    chosen = result["chosen"]
    if chosen is not None and chosen["micro_batches"] != c["micro_batches"]:
        notes.append(
            f"the rows are for the batch as given; the chosen spec is for B={chosen['batch']} "
            f"x{chosen['micro_batches']} micro-batches (--split-batch: the whole batch fits no spec)"
        )
    notes.append(f"{compiler_label(result['measured_on'])} peaks were {result['caveat']}")
    estimated = all(r.get("estimated_seconds") is not None for r in result["rows"])
    if estimated:
        notes.append(
            f"est. step: the step's FLOPs with its recompute at {result['device']}'s peak rate, plus its "
            "offload traffic: an estimate, compute-bound, nothing ran"
        )
    caption = ". ".join(n[0].upper() + n[1:] for n in notes) + "."
    t = Table(title=title, caption=caption, box=box.SIMPLE_HEAD)
    t.add_column("remat", justify="left")
    for header, _ in _SIZE_COLUMNS:
        t.add_column(header, justify="right")
    hosted = any(r.get("host_bytes") for r in result["rows"])  # offloaded state or activations
    for header in (*(["host"] if hosted else []), "fits", "recompute", *(["est. step"] if estimated else [])):
        t.add_column(header, justify="right")
    t.add_column("measured", justify="right")
    for r in result["rows"]:
        is_chosen = chosen is not None and r["remat"] == chosen["remat"]
        fits = chosen["measured_bytes"] <= result["usable_bytes"] if is_chosen else r["fits"]  # XLA's
        t.add_row(
            ("* " if is_chosen else "  ") + r["remat"],
            *(plan.format_bytes(r[key]) for _, key in _SIZE_COLUMNS),
            *([plan.format_bytes(r["host_bytes"])] if hosted else []),
            "yes" if fits else "no",
            _percent(r["recompute_fraction"]),
            *([_duration(r["estimated_seconds"])] if estimated else []),
            plan.format_bytes(chosen["measured_bytes"]) if is_chosen else "",
            style="bold" if is_chosen else None,
        )
    return t


def _duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def roofline_line(chosen: dict, device: str, label: str) -> str | None:
    """The chosen step's FLOPs and bytes from the compiler's cost analysis, and their roofline
    time on ``device`` (an estimate: the step never ran); None without them."""
    if chosen.get("roofline_seconds") is None:
        return None
    flops, moved = chosen["step_flops_estimate"], chosen["step_bytes_estimate"]
    return (
        f"  estimate ({label} cost analysis, its layer loop counted n_layers times and its attention "
        f"kernels' FLOPs added; never ran): "
        f"{flops / 1e12:.3g} TFLOP and {plan.format_bytes(moved)} accessed per step, roofline "
        f"{_duration(chosen['roofline_seconds'])} on {device}"
    )


def _percent(fraction: float) -> str:
    return "<0.1%" if 0 < fraction < 0.001 else f"{fraction:.1%}"


def compression_notes(compression: dict) -> list[str]:
    """What the table's rows and choice may compress (``--allow-compress``, ``--compress``).

    Example:
        >>> compression_notes({"allow": True, "format": "int8", "tags": None})
        ['the solver may store kept activations in int8 (--allow-compress)']
        >>> compression_notes({"allow": False, "format": "fp8", "tags": ["attn_out"]})
        ['every spec keeps attn_out in fp8 where it keeps it (--compress)']
    """
    if compression.get("allow"):
        return [f"the solver may store kept activations in {compression['format']} (--allow-compress)"]
    if compression.get("format"):
        what = ", ".join(compression["tags"]) if compression.get("tags") else "what it keeps"
        return [f"every spec keeps {what} in {compression['format']} where it keeps it (--compress)"]
    return []


def compressed_text(chosen: dict) -> str:
    """The chosen spec's compressed tags, each with its format and its stored bytes against its
    bytes uncompressed (one micro-batch, every layer), or ``""``.

    Example:
        >>> compressed_text({"compressed": [{"tag": "layer_input", "format": "int8", "bytes": 2**20,
        ...                                  "uncompressed_bytes": 2**21}]})
        'stores layer_input in int8 (1.00 MiB of 2.00 MiB)'
    """
    size = plan.format_bytes
    parts = [
        f"{c['tag']} in {c['format']} ({size(c['bytes'])} of {size(c['uncompressed_bytes'])})"
        for c in chosen.get("compressed", [])
    ]
    return "stores " + ", ".join(parts) if parts else ""


def chosen_line(chosen: dict, config: dict, label: str) -> str:
    """One line on the chosen spec: what a solved spec keeps per layer, what it compresses, and
    XLA's peak."""
    spec, what = chosen["spec"], "a preset"
    if "groups" in spec:  # remat.Layered (--per-layer): "remat" names its groups, "3 x save_attn + 3 x full"
        what = f"per layer: {layer_groups_text(spec['groups'])}"
    elif "+" in chosen["remat"]:  # full+int8: a preset with its kept activations compressed
        what = f"a preset, what it keeps in {chosen['remat'].partition('+')[2]}"
    if chosen["remat"] == "solved":
        what = f"keeps {', '.join(spec['save']) or 'only the layer input'} per layer"
        if spec["offload"]:
            what += f", offloads {', '.join(spec['offload'])}"
        what += ", recomputes the rest"
    squeezed = compressed_text(chosen)
    if squeezed:
        what += f"; {squeezed}"
    peak = plan.format_bytes(chosen["measured_bytes"])
    split = ""
    if chosen["micro_batches"] != config["micro_batches"]:
        split = f" at B={chosen['batch']} x{chosen['micro_batches']} micro-batches"
    host = chosen.get("measured_host_bytes", 0)
    on_host = f" (+{plan.format_bytes(host)} in host memory)" if host else ""
    return f"* chosen: {chosen['remat']} ({what}){split}; {label} measured a {peak} peak{on_host}"


def layer_groups_text(groups: list[dict]) -> str:
    """What each group of a per-layer spec keeps, by its layers' indices.

    Example:
        >>> layer_groups_text([{"layers": 2, "save": ["attn_lse", "attn_out"]}, {"layers": 3, "save": []}])
        'layers 0-1 keep attn_lse, attn_out; layers 2-4 keep only their input; the rest recomputed'
    """
    parts, start = [], 0
    for group in groups:
        end = start + group["layers"] - 1
        where = f"layer {start}" if end == start else f"layers {start}-{end}"
        kept = ", ".join(map(str, group["save"])) or "only their input"
        parts.append(f"{where} keep {kept}")
        start = end + 1
    return "; ".join(parts) + "; the rest recomputed"


def attempts_line(attempts: list[dict], label: str) -> str:
    """The specs the planner compiled: predicted -> measured, so a miss of the model shows."""
    tried = "; ".join(
        f"{a['remat']} {plan.format_bytes(a['predicted_bytes'])} -> {plan.format_bytes(a['measured_bytes'])}"
        for a in attempts
    )
    return f"  compiled (predicted -> {label}): {tried}"
