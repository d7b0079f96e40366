"""bench.step_breakdown in its quick form: the step's parts are the timed kernel calls plus the rest, and the
kernel module the engine saw was the timing wrapper (timings are not checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import step_breakdown


def test_parts_add_up_to_the_step_and_name_the_kernels(tmp_path: Path) -> None:
    """Each batch's parts sum to its step; the attention kernel and the linears by shape are among them;
    the engine's kernel module is the real one again afterwards."""
    from inference.engine import cpu_kernels

    real = cpu_kernels.load_kernels()
    if real is None:
        pytest.skip("CPU kernels unavailable here")
    assert step_breakdown.main(["--quick", "--out-dir", str(tmp_path), "--dtype", "float32"]) == 0
    assert cpu_kernels.load_kernels() is real
    result = json.loads((tmp_path / "step_breakdown_quick.json").read_text())
    (run,) = result["runs"]
    parts = run["parts_ms"]
    assert sum(parts.values()) == pytest.approx(run["step_ms"])
    assert parts["paged_decode"] > 0
    # The engine's own GEMMs where it chose them on this CPU (oneDNN's linears fall in the rest).
    linears = [name for name in parts if name.startswith(("panel_linear ", "amx_linear "))]
    assert all(run["calls_per_step"][name] >= 1 for name in linears)


def test_linear_calls_are_labelled_by_shape() -> None:
    """A linear's label is its kernel and its weight's (out, in); other calls keep their name."""
    import torch

    class Ops:
        def panel_linear(self, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
            return torch.zeros(x.shape[0], n)

        def rms_norm(self, x: torch.Tensor) -> torch.Tensor:
            return x

    timed = step_breakdown.TimedOps(Ops())
    timed.panel_linear(torch.zeros(3, 8), torch.zeros(1), 5)
    timed.rms_norm(torch.zeros(2))
    assert set(timed.totals) == {"panel_linear 5x8", "rms_norm"}
    assert timed.calls["panel_linear 5x8"] == 1


def test_prefill_mode_parts_add_up_and_name_attention_and_linears(tmp_path: Path) -> None:
    """The prefill mode's parts (linears by projection and kernel, attention, KV writes, kernels, glue)
    sum to the step; the model's methods are its class's again afterwards."""
    from inference.engine import cpu_kernels

    if cpu_kernels.load_kernels() is None:
        pytest.skip("CPU kernels unavailable here")
    assert step_breakdown.main(["--quick", "--prefill", "1x32", "--out-dir", str(tmp_path), "--dtype", "float32"]) == 0
    result = json.loads((tmp_path / "step_breakdown_prefill_quick.json").read_text())
    assert [(r["prompts"], r["tokens"]) for r in result["prefill"]] == [(1, 32), (2, 16)]
    for run in result["prefill"]:
        parts = run["parts_ms"]
        assert sum(parts.values()) == pytest.approx(run["step_ms"])
        assert parts["attention (Attention._prefill)"] > 0 and parts["KV cache writes (index_copy_)"] > 0
        assert any(name.startswith("linear gate_up_proj (") for name in parts)
        assert any(name.startswith("linear lm_head (") for name in parts)
        assert not any(name.startswith(("kernel amx_linear", "kernel panel_linear")) for name in parts)
