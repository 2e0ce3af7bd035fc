"""``plan.max_seq`` and ``jaxckpt plan --max-seq``: the longest sequence that fits, confirmed by XLA.

The model is ``tiny`` with two layers and odd sizes; XLA:CPU confirms. One search is shared by
the module (``functools.cache``): it compiles one or two steps.
"""

import functools
import json
import re

import pytest

from jaxckpt import nn, plan, remat
from jaxckpt.cli import main
from jaxckpt.plan._max_seq import _Compression, _fitting, _host_bound, _plans, at_length

CONFIG = nn.TransformerConfig.preset(
    "tiny", n_layers=2, d_model=72, n_heads=3, n_kv_heads=1, ffn_dim=200, vocab_size=301
)
BUDGET = 24 * 2**20
MULTIPLE = 128


SPECS = ("full", "offload_full")
"""The presets searched. The solver's per-tag specs are left out here: on XLA:CPU, which keeps
float32 copies of what it saves, the analytic model misses them by up to 22% on this model."""


@functools.cache
def _answer() -> plan.MaxSeqAnswer:
    return plan.max_seq(plan.Workload(CONFIG, batch=1, seq=1), BUDGET, specs=SPECS, multiple=MULTIPLE)


@pytest.mark.slow
def test_the_longest_sequence_fits_and_the_next_does_not():
    answer = _answer()
    assert answer.max_seq >= MULTIPLE and answer.max_seq % MULTIPLE == 0
    assert answer.measured_on == "xla-cpu"
    # confirmed by the compiler: the last compile is at the answer, and it fits
    assert answer.attempts[-1] == {
        "seq": answer.max_seq,
        "measured_bytes": answer.measured_bytes,
        "fits": True,
    }
    assert answer.measured_bytes <= answer.usable_bytes == BUDGET
    # the prediction at the length it reports is within 10% of XLA's peak
    assert abs(answer.predicted_bytes / answer.measured_bytes - 1) <= 0.10
    # and one multiple more is predicted over the budget for every plan tried
    longer = at_length(plan.Workload(CONFIG, batch=1, seq=1), answer.max_seq + MULTIPLE)
    assert all(plan.predict(longer, name).total > BUDGET for name in SPECS) or (
        answer.predicted_max_seq > answer.max_seq  # or the compiler said no first
    )


def test_the_answer_is_json_and_names_its_plan():
    answer = plan.MaxSeqAnswer(4096, 4096, plan.SeqPlan(remat.get("full"), 1024), 1, 2, 3, 4, "x")
    out = json.loads(json.dumps(answer.to_dict()))
    assert out["plan"] == {"remat": "full", "spec": plan.spec_dict(answer.plan.spec), "mlp_chunk": 1024}
    assert {"max_seq", "measured_bytes", "host_bytes", "attempts", "caveat"} <= set(out)


def test_nothing_fits_a_budget_under_the_state():
    answer = plan.max_seq(plan.Workload(CONFIG, batch=1, seq=1), 2**20, multiple=MULTIPLE)
    assert answer.max_seq == 0 and answer.plan is None and answer.attempts == ()
    assert "not even 128 tokens fit" in answer.notes[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq", "64", "--max-seq"], "give one of --seq N"),
        ([], "give one of --seq N"),
        (["--max-seq", "--remat", "full"], "--max-seq chooses the remat spec itself"),
        (["--seq", "64", "--host-memory", "1GiB"], "--host-memory bounds the --max-seq search"),
    ],
)
def test_cli_flag_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "tiny", "--batch", "1", "--budget", "20MiB", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_cli_max_seq_json(capsys, monkeypatch):
    calls = []

    def search(workload, budget, **options):  # the module's one search stands for the CLI's
        calls.append((workload, budget, options))
        return _answer()

    monkeypatch.setattr(plan, "max_seq", search)
    argv = ["plan", "--model", "tiny", "--batch", "1", "--budget", "24MiB", "--headroom", "0.1"]
    code = main([*argv, "--max-seq", "--mlp-chunk", "256", "--host-memory", "1GiB", "--json"])
    result = json.loads(capsys.readouterr().out)
    ((workload, budget, options),) = calls
    assert workload.batch == 1 and workload.config.mlp_chunk == 256 and budget == BUDGET
    assert options == {
        "device": None,
        "target": None,
        "headroom": 0.1,
        "host_budget": 2**30,
        "compress": None,
        "compress_tags": None,
        "allow_compress": False,
    }
    assert code == 0 and result["max_seq"] == _answer().max_seq
    assert result["plan"]["remat"] and result["measured_bytes"] <= result["usable_bytes"]


# -- with compressed residuals (issue 34) ---------------------------------------------------


DEEP = plan.Workload(CONFIG.replace(n_layers=16), batch=1, seq=1)
"""16 layers: their inputs are a large share of the step (fp32 on XLA:CPU), so int8 ones make room
(at 2 layers the float32 groups the quantization forms would take more than they save)."""
DEEP_BUDGET = 32 * 2**20


@functools.cache
def _full(compress: "str | None") -> plan.MaxSeqAnswer:
    """``full`` remat, the MLP untiled, with the layer inputs as ``compress`` says."""
    return plan.max_seq(
        DEEP, DEEP_BUDGET, specs=["full"], tiles=[None], multiple=MULTIPLE, compiles=3, compress=compress
    )


@pytest.mark.slow
def test_int8_layer_inputs_reach_a_longer_sequence_confirmed_by_the_compiler():
    plain, int8 = _full(None), _full("int8")
    assert plain.plan.spec == remat.get("full")
    assert int8.plan.spec == remat.compressed("full", "int8")  # every candidate compressed
    assert int8.max_seq > plain.max_seq and int8.predicted_max_seq > plain.predicted_max_seq
    # the compiled confirmation compiled the compressed step: the same peak as measuring it
    longest = at_length(DEEP, int8.max_seq)
    assert int8.measured_bytes == plan.measure(longest, remat.compressed("full", "int8")).peak
    assert int8.measured_bytes <= DEEP_BUDGET < plan.measure(longest, "full").peak


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"compress": "int4"}, "max_seq: compress='int4' must be one of int8, fp8"),
        ({"compress_tags": ["layer_input"]}, "max_seq: compress_tags= needs compress="),
        ({"compress": "int8", "compress_tags": ["bogus"]}, "max_seq: compress_tags names ['bogus']"),
        ({"allow_compress": "yes"}, "max_seq: allow_compress='yes' must be True or False"),
    ],
)
def test_compression_arguments_are_checked_by_name(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan.max_seq(plan.Workload(CONFIG, batch=1, seq=1), BUDGET, **options)


@pytest.mark.slow
def test_allow_compress_lets_the_solvers_candidate_compress_where_it_is_cheaper():
    """At 1408 tokens (past ``full``'s longest on ``DEEP``) the solver's candidate offloads; with
    ``allow_compress`` it may also compress, and it does, for a step predicted no slower."""
    cpu, seconds = plan.DEVICES["cpu"], {}
    for allow in (False, True):
        plans = _plans(DEEP, [None], [None], _Compression.of(None, None, allow))
        chosen, predicted = _fitting(DEEP, 1408, (DEEP_BUDGET, None), cpu, None, plans)
        assert bool(chosen.spec.compress) == allow and predicted.total <= DEEP_BUDGET
        seconds[allow] = plan.choice(at_length(DEEP, 1408), chosen.spec).seconds(cpu)
    assert seconds[True] <= seconds[False]


@pytest.mark.slow  # a dozen predictions at new lengths
def test_the_compiles_never_move_past_the_host_budget():
    """The compiled confirmation moves T by the device's figures: ``_host_bound`` caps it at the
    longest T whose predicted host memory is within the host budget."""
    workload, offload = plan.Workload(CONFIG, batch=1, seq=1), plan.SeqPlan(remat.get("offload_full"), None)
    host = 3 * 2**20
    longest = _host_bound(workload, offload, host, None, 1024, 8192)  # few lengths: each is a prediction
    assert longest > 0 and longest % 1024 == 0

    def host_at(seq: int) -> int:
        return plan.predict(at_length(workload, seq), offload.spec).host

    assert host_at(longest) <= host < host_at(longest + 1024)
    assert _host_bound(workload, offload, None, None, 1024, 8192) == 8192
