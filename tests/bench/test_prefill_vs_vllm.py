"""bench.prefill_vs_vllm: its cases and prompt sets, and an A/B of an environment switch on our side alone
(the quick form, tiny model; timings are not checked)."""
from __future__ import annotations

import json
from pathlib import Path

from bench import prefill_vs_vllm


def test_cases_and_fresh_prompt_sets() -> None:
    """"PxT" is P prompts of T tokens; every set and the warm-up hold distinct prompts of that shape."""
    cases = prefill_vs_vllm.parse_cases("1x512, 4x64")
    assert cases == [("1x512", 1, 512), ("4x64", 4, 64)]
    configs = prefill_vs_vllm.case_configs(cases, repeats=3, vocab=1000)
    for (_, n, length), cfg in zip(cases, configs, strict=True):
        groups = [cfg["warmup"], *cfg["sets"]]
        assert len(groups) == 4 and all(len(g) == n and all(len(p) == length for p in g) for g in groups)
        prompts = [tuple(p) for g in groups for p in g]
        assert len(set(prompts)) == len(prompts)


def test_baseline_env_ab_without_vllm(tmp_path: Path) -> None:
    """With --baseline-env and --no-vllm each round runs our engine twice (the baseline's environment
    first) and the A/B rows carry per-round ratios; no vLLM rows."""
    argv = ["--quick", "--no-vllm", "--baseline-env", "INFERENCE_GEMM_ATTENTION=1", "--out-dir", str(tmp_path)]
    assert prefill_vs_vllm.main(argv) == 0
    result = json.loads((tmp_path / "prefill_vs_vllm_quick.json").read_text())
    assert result["rows"] == [] and result["vllm_runs"] == []
    assert len(result["baseline_runs"]) == len(result["ours_runs"]) == 1
    assert [r["case"] for r in result["ab_rows"]] == ["1x64", "2x64"]
    for row in result["ab_rows"]:
        assert len(row["ratio"]) == 1 and row["ratio"][0] > 0


def test_baseline_tree_runs_the_baseline_from_that_checkout(tmp_path: Path) -> None:
    """--baseline-tree runs the baseline's process from the given checkout (here this one again) and
    records it; the A/B rows come out as with an environment switch."""
    from bench.common import ROOT

    argv = ["--quick", "--no-vllm", "--baseline-tree", str(ROOT), "--out-dir", str(tmp_path)]
    assert prefill_vs_vllm.main(argv) == 0
    result = json.loads((tmp_path / "prefill_vs_vllm_quick.json").read_text())
    assert result["baseline_tree"] == str(ROOT) and result["baseline_env"] == []
    assert len(result["baseline_runs"]) == 1 and len(result["ab_rows"]) == 2
