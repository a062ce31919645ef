"""benches/ scripts that the lead runs on the GPU once: their CPU smoke paths and pure parts."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"
TINY = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32}


def _load(script: str) -> ModuleType:
    """A script under benches/ (`diagnostics/step_intervals`), imported as a module by its name."""
    spec = importlib.util.spec_from_file_location(Path(script).name, BENCHES / f"{script}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pdk() -> ModuleType:
    """The report half of diagnostics/profile_decode_kernels.py (the script itself runs in a subprocess)."""
    return _load("diagnostics/decode_step_report")


def test_decode_kernel_names_land_in_their_classes(pdk: ModuleType) -> None:
    def cls(name: str, *, in_graph: bool = True, phase: str | None = "ts::forward",
            fp8: bool = False) -> str:
        return pdk.classify(pdk.Kernel(name, 1.0, in_graph, phase), graphs=True, fp8_weights=fp8)

    assert cls("_decode_split_kernel") == "attention"
    assert cls("_rotary_kv_kernel") == "kv_write"
    assert cls("_fused_add_rmsnorm_kernel") == "norm_act"
    assert cls("_silu_and_mul_kernel") == "norm_act"
    assert cls("_per_token_quant_kernel") == "act_quant"
    assert cls("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN") == "gemm_bf16"
    assert cls("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128") == "gemm_fp8"
    assert cls("nvjet_tst_192x192_64x4", fp8=True) == "gemm_fp8"  # every weight fp8: by the model
    assert cls("void at::native::elementwise_kernel<copy>") == "other"
    # Outside the graph the phase decides: the sampler's argmax and the step's input copies.
    assert cls("void at::native::reduce_kernel<argmax>", in_graph=False, phase="ts::sample") == "sampling"
    assert cls("Memcpy HtoD (Pinned -> Device)", in_graph=False, phase="ts::forward") == "inputs"


def _trace() -> dict:
    """A Chrome trace in Kineto's layout: one step, a graph launch inside ts::forward (two kernels
    it ran), an eager input copy, and the sampler's kernel inside ts::sample."""
    x = "X"
    return {"traceEvents": [
        {"ph": x, "cat": "user_annotation", "name": "ts::forward", "ts": 100.0, "dur": 50.0},
        {"ph": x, "cat": "user_annotation", "name": "ts::sample", "ts": 160.0, "dur": 20.0},
        {"ph": x, "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 105.0, "dur": 1.0,
         "args": {"correlation": 1}},
        {"ph": x, "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 110.0, "dur": 5.0,
         "args": {"correlation": 2}},
        {"ph": x, "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 165.0, "dur": 2.0,
         "args": {"correlation": 3}},
        {"ph": x, "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 200.0, "dur": 4.0,
         "args": {"correlation": 1}},
        {"ph": x, "cat": "kernel", "name": "_decode_split_kernel", "ts": 210.0, "dur": 600.0,
         "args": {"correlation": 2, "grid": [411, 8, 1], "block": [128, 1, 1],
                  "registers per thread": 128, "shared memory": 32768}},
        {"ph": x, "cat": "kernel", "name": "nvjet_hsh_gemm", "ts": 820.0, "dur": 300.0,
         "args": {"correlation": 2, "grid": [66, 1, 1], "block": [384, 1, 1]}},
        {"ph": x, "cat": "kernel", "name": "argmax_kernel", "ts": 1200.0, "dur": 10.0,
         "args": {"correlation": 3}},
    ]}


def test_trace_kernels_know_their_graph_and_phase(pdk: ModuleType) -> None:
    kernels = {k.name: k for k in pdk.cuda_kernels(_trace())}
    assert kernels["_decode_split_kernel"].in_graph and kernels["nvjet_hsh_gemm"].in_graph
    assert kernels["_decode_split_kernel"].grid == (411, 8, 1)
    assert kernels["_decode_split_kernel"].regs == 128
    copy = kernels["Memcpy HtoD (Pinned -> Device)"]
    assert not copy.in_graph and copy.phase == "ts::forward"
    assert kernels["argmax_kernel"].phase == "ts::sample"


def test_summary_splits_a_step_and_counts_the_idle_graph_time(pdk: ModuleType) -> None:
    res = pdk.Result("fp8kv", "x", batch=411, graph_batch=416, context=1536, weights="bfloat16",
                     kv_dtype="fp8", fill="random", replay_ms=1.0)
    res.roofline = {"kv_bytes": 1.2e9}
    pdk.summarize(res, pdk.cuda_kernels(_trace()), steps=1, graphs=True, fp8_weights=False, top_n=5)
    ms = res.classes_ms
    assert ms["attention"] == pytest.approx(0.6) and ms["gemm_bf16"] == pytest.approx(0.3)
    assert ms["inputs"] == pytest.approx(0.004) and ms["sampling"] == pytest.approx(0.01)
    assert res.graph_gaps_ms == pytest.approx(0.1)  # 1.0 ms replay, 0.9 ms of its kernels
    assert res.graph_kernels == 2
    assert res.profiled_ms == pytest.approx(1.0 + 0.004 + 0.01)
    assert res.attention_gbs == pytest.approx(2000.0)  # 1.2 GB in 0.6 ms
    assert res.top[0]["name"] == "_decode_split_kernel" and res.top[0]["grid"] == (411, 8, 1)


def test_roofline_of_an_fp8_step(pdk: ModuleType) -> None:
    # One layer, one fp8 linear of 1000 x 1000 at 10 rows; 2 requests of 99 (+1) tokens.
    s = pdk.Shapes([("l", 1000, 1000, True)], layers=1, hidden=1000, intermediate=1000, q_heads=4,
                   kv_heads=2, head_dim=10, vocab=100, act_bytes=2, kv_bytes=1)
    r = pdk.roofline(s, batch=2, rows=10, context=99, bw=1e9, bf16_flops=1e12, fp8_flops=2e12)
    assert r["weight_bytes"] == 1_000_000 and r["matmul_flops"] == 20_000_000
    assert r["kv_bytes"] == 2 * 100 * 2 * 2 * 10  # tokens x (K, V) x heads x dim x 1 byte
    # bytes (weights + fp8 input + bf16 output) over 1 GB/s beat FLOPs over 2 PFLOP/s
    assert r["floors_ms"]["gemm_fp8"] == pytest.approx(1e3 * (1_000_000 + 10_000 + 20_000) / 1e9)
    assert r["floors_ms"]["gemm_bf16"] == 0.0


def test_cpu_smoke_run_writes_the_class_table(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCHES / "diagnostics" / "profile_decode_kernels.py"), "--device", "cpu",
           "--layers", "2", "--batch-sizes", "2", "--context", "24", "--dtype", "float32",
           "--config-overrides", json.dumps(TINY), "--out", str(tmp_path), "--step-reps", "2",
           "--profile-steps", "1", "--warmup", "1", "--attn-sweep", "32x4x2,32x4x2h"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "profile_decode_kernels.json").read_text())
    assert [c["config"] for c in report["configs"]] == ["bf16", "fp8kv", "fp8both"]
    assert report["skipped"] == []
    for c in report["configs"]:
        assert set(c["classes_ms"]) == set(report["classes"])
        assert all(math.isfinite(v) and v >= 0 for v in c["classes_ms"].values())
        assert c["classes_ms"]["attention"] > 0 and c["step_ms"] > 0 and c["profiled_ms"] > 0
        assert c["roofline"]["kv_bytes"] == 2 * 25 * 2 * 2 * 2 * 32 * (4 if c["kv_dtype"] == "auto" else 1)
        # the kernel alone (Triton's interpreter here): its default launch config, then the grid's
        assert [(a["config"], a["f16_dots"]) for a in c["attn_sweep"]] == [([None, 4, None], None), ([32, 4, 2], False), ([32, 4, 2], True)]
        assert all(a["us"] > 0 and a["gbs"] > 0 for a in c["attn_sweep"])
    gemm = {c["config"]: (c["classes_ms"]["gemm_bf16"], c["classes_ms"]["gemm_fp8"]) for c in report["configs"]}
    assert gemm["bf16"][0] > 0 and gemm["bf16"][1] == 0
    assert gemm["fp8both"][1] > 0 and gemm["fp8both"][0] == 0
    md = (tmp_path / "profile_decode_kernels.md").read_text()
    for label in ("decode attention", "GEMM/GEMV bf16", "GEMM/GEMV fp8", "norm / rotary / activation",
                  "rotary + KV write", "sampling (outside graph)", "**total**", "| 32x4x2 | "):
        assert label in md


@pytest.fixture(scope="module")
def si() -> ModuleType:
    return _load("diagnostics/step_intervals")


def test_step_intervals_from_the_worker_trace(si: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    """The trace's lines parse back; intervals are between consecutive sends, without the idle
    time before a step, cut to a window, and broken where step ids skip."""
    import logging
    import time

    from tokenspeed.diagnostics.step_trace import StepTrace
    from tokenspeed.worker.plan import StepPlan

    trace = StepTrace(every=1)
    with caplog.at_level(logging.INFO, logger="tokenspeed.diagnostics.step_trace"):
        for step in range(3):
            trace.received(StepPlan.build(step, new=[], page_tables=[(0, 0, [1])],
                                          scheduled=[(0, 0, [5, 6], True)]))
            time.sleep(0.01)
            trace.sent(step)
    steps = si.parse("\n".join(f"INFO {r.getMessage()}" for r in caplog.records))
    assert [s.step for s in steps] == [0, 1, 2] and steps[1].tokens == 2 and steps[1].batch == 1
    gaps = [ms for ms, _ in si.intervals(steps)]
    assert len(gaps) == 2 and all(5.0 <= g <= 1000.0 for g in gaps)

    Step = si.Step
    synthetic = [Step(0, 8, 8, 0, 0.0, 10.000), Step(1, 8, 8, 0, 0.0, 10.020),
                 Step(2, 9, 1032, 1, 5.0, 10.080), Step(4, 8, 8, 0, 0.0, 10.090),
                 Step(5, 8, 8, 0, 0.0, 10.100)]
    pairs = si.intervals(synthetic)
    # 20 ms; 60 ms less 5 ms idle; (2 -> 4 skips a step: no interval); 10 ms.
    assert [round(ms, 3) for ms, _ in pairs] == [20.0, 55.0, 10.0]
    assert [round(ms, 3) for ms, _ in si.intervals(synthetic, since=10.01)] == [55.0, 10.0]
    s = si.summarize(pairs, slowest=1)
    assert s["max_ms"] == pytest.approx(55.0) and s["slowest"][0]["tokens"] == 1032
    assert si.summarize([]) is None


# --- benches/scenarios/scoreboard.py: comparison, flags, resuming ------------------------------

@pytest.fixture(scope="module")
def sb() -> ModuleType:
    return _load("scenarios/scoreboard")


def _sb_entry(sb: ModuleType, sid: str, prec: str, metrics: dict[str, float], *, status: str = "ok",
              gpu: str = "G", quick: bool = False, s1_prompts: int = 2000) -> dict:
    wl = sb.workloads(quick, s1_prompts=s1_prompts)[sid]
    return {"scenario": sid, "precision": prec, "status": status, "gpu": gpu, "quick": quick,
            "commit": "abc1234", "date": "2026-12-01", "workload": wl.text, "prompts": wl.prompts,
            "args": wl.args, "metrics": metrics}


def test_scoreboard_flags_rows_worse_by_more_than_3_percent_in_their_direction(sb: ModuleType) -> None:
    lower, higher = False, True
    assert sb.compare(104.0, 100.0, lower) == (pytest.approx(4.0), "WORSE")  # latency up 4%
    assert sb.compare(102.0, 100.0, lower) == (pytest.approx(2.0), "")
    assert sb.compare(96.0, 100.0, lower) == (pytest.approx(-4.0), "better")
    assert sb.compare(96.0, 100.0, higher) == (pytest.approx(-4.0), "WORSE")  # throughput down 4%
    assert sb.compare(98.0, 100.0, higher) == (pytest.approx(-2.0), "")
    assert sb.compare(104.0, 100.0, higher) == (pytest.approx(4.0), "better")
    assert sb.compare(5.0, None, lower) == (None, "new")
    assert sb.compare(None, 5.0, lower) == (None, "not run")


def _cell(value: float, note: str | None = None) -> dict:
    cell = {"value": value, "commit": "ddcddc1", "date": "2026-11-26"}
    return cell | ({"note": note} if note else {})


# The numbers the scoreboard was seeded with (issue 29's third-party runs, session 15): the real
# baseline file moves with every --record, so the table is checked against a fixed copy.
SEEDED_BASELINE = {"NVIDIA H100 80GB HBM3": {
    "S1": {"bf16": {"output tok/s": _cell(7312)},
           "fp8-kv": {"output tok/s": _cell(8049, "measured with 1000 requests")},
           "fp8-both": {"output tok/s": _cell(7474)}},
    "S2": {"bf16": {"median TTFT ms": _cell(39.44), "p99 ITL ms": _cell(29.31)}},
    "S3": {"bf16": {"median TPOT ms": _cell(5.8), "median TTFT ms": _cell(9.9)}}}}


def test_scoreboard_baseline_file_names_a_gpu_and_its_cells(sb: ModuleType) -> None:
    base = sb.load_baseline(sb.BASELINE)
    gpus = [k for k in base if not k.startswith("_")]
    assert gpus, "at least one GPU recorded"
    for gpu in gpus:
        cell = sb.baseline_cell(base, gpu, "S1", "bf16", "output tok/s")
        assert cell is not None and cell["value"] > 0 and cell["commit"] and cell["date"]


def test_scoreboard_table_against_the_seeded_baseline(sb: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(SEEDED_BASELINE))
    base = sb.load_baseline(path)
    gpu = "NVIDIA H100 80GB HBM3"
    cell = sb.baseline_cell(base, gpu, "S1", "fp8-kv", "output tok/s")
    assert cell["value"] == 8049 and cell["commit"] == "ddcddc1" and cell["date"] == "2026-11-26"
    assert "1000 requests" in cell["note"]
    assert sb.baseline_cell(base, gpu, "S2", "bf16", "p99 ITL ms")["value"] == 29.31
    entries = {("S1", "bf16"): _sb_entry(sb, "S1", "bf16", {"output tok/s": 7312 * 0.96, "max ITL ms": 150.0}),
               ("S3", "bf16"): _sb_entry(sb, "S3", "bf16", {"median TPOT ms": 5.80 * 1.02,
                                                            "median TTFT ms": 9.9 * 0.9}),
               ("S2", "fp8-kv"): _sb_entry(sb, "S2", "fp8-kv", {}, status="timed out")}
    rows = sb.build_rows(entries, base, gpu, list(sb.PRECISIONS), list(sb.SCENARIOS))
    by = {(r.scenario, r.precision, r.metric): r for r in rows}
    assert len(rows) == 18
    assert by[("S1", "bf16", "output tok/s")].flag == "WORSE"
    assert by[("S1", "bf16", "max ITL ms")].flag == "new"  # nothing recorded for it
    assert by[("S3", "bf16", "median TPOT ms")].flag == ""
    assert by[("S3", "bf16", "median TTFT ms")].flag == "better"
    assert by[("S2", "fp8-kv", "median TTFT ms")].flag == "TIMED OUT"
    assert by[("S1", "fp8-both", "output tok/s")].flag == "not run"
    table = sb.render(rows, "title", entries, sb.workloads())
    assert "| S1 | bf16 | output tok/s | 7,020 | 7,312 | -4.0% | **WORSE** |" in table
    assert "| S1 | bf16 | max ITL ms | 150.00 | - | - | new |" in table
    assert "| S3 | bf16 | median TPOT ms | 5.92 | 5.80 | +2.0% |  |" in table
    assert "1 row(s) more than 3% worse" in table and "1000 requests" in table
    # Another GPU has no recorded numbers: every measured row is new.
    assert {r.flag for r in sb.build_rows(entries, base, "NVIDIA H200", ["bf16"], ["S1"])} == {"new"}


def test_scoreboard_resumes_what_out_does_not_hold(sb: ModuleType) -> None:
    wl = sb.workloads()
    results = [
        _sb_entry(sb, "S3", "bf16", {}),
        _sb_entry(sb, "S2", "bf16", {}, status="failed"),
        _sb_entry(sb, "S1", "bf16", {}, s1_prompts=400),  # another workload: runs again
        _sb_entry(sb, "S3", "fp8-kv", {}, gpu="other"),  # another GPU: runs here
        _sb_entry(sb, "S2", "fp8-kv", {}, quick=True),  # quick runs are kept apart
        _sb_entry(sb, "S1", "fp8-kv", {}, status="failed"),
        _sb_entry(sb, "S1", "fp8-kv", {}),  # the last line wins
    ]
    precs, scens = list(sb.PRECISIONS), list(sb.SCENARIOS)
    assert sb.pending(results, "G", False, wl, precs, scens) == {
        "bf16": ["S2", "S1"], "fp8-kv": ["S3", "S2"], "fp8-both": ["S3", "S2", "S1"]}
    assert sb.pending(results, "G", False, wl, precs, scens, rerun=True) == {p: scens for p in precs}
    assert sb.pending(results, "G", False, sb.workloads(s1_prompts=400), ["bf16"], ["S3", "S1"]) == {}


def test_scoreboard_runs_only_what_is_missing_and_records(sb: ModuleType, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The matrix loop against a stand-in server and bench: a second run with the same --out runs
    nothing, a failed (scenario, precision) runs again, --report-only --record writes the baseline."""
    ran: list[str] = []
    servers: list[tuple[str, list[str]]] = []
    failing = {"S2/fp8-kv"}

    def start_server(ctx: object, model_dir: Path, tag: str, extra: list[str], timeout_s: float) -> tuple:
        servers.append((tag, extra))
        return object(), "http://x"

    def run_scenario(ctx: object, url: str, tok: Path, sc: object, log: Path) -> tuple[str, dict]:
        ran.append(sc.sid)  # type: ignore[attr-defined]
        status = "failed" if sc.sid in failing else "ok"  # type: ignore[attr-defined]
        metrics = {"output_throughput": 7000.0, "itl_ms": {"max": 100.0, "p99": 25.0},
                   "ttft_ms": {"median": 10.0}, "tpot_ms": {"median": 5.5}}
        return status, {"commit": "0123456789abcdef", "metrics": metrics, "stagger_starts": False}

    monkeypatch.setattr(sb.gpu_bench, "start_server", start_server)
    monkeypatch.setattr(sb.gpu_bench, "run_scenario", run_scenario)
    monkeypatch.setattr(sb.gpu_bench, "stop_server", lambda proc: None)
    monkeypatch.setattr(sb, "repo_commit", lambda: None)  # then the bench record's commit
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"G": {"S3": {"bf16": {"median TPOT ms": {"value": 5.0, "commit": "x",
                                                                          "date": "d"}}}}}))
    out = tmp_path / "out"
    common = ["--out", str(out), "--gpu", "G", "--tokenizer", str(tok), "--baseline", str(base),
              "--only-precision", "fp8-kv,bf16", "--budget-s", "100000"]
    assert sb.main(common) == 0
    assert ran == ["S3/bf16", "S2/bf16", "S1/bf16", "S3/fp8-kv", "S2/fp8-kv", "S1/fp8-kv"]
    assert [t for t, _ in servers] == ["bf16", "fp8-kv"] and servers[1][1] == ["--kv-cache-dtype", "fp8"]
    summary = (out / "summary.md").read_text()
    assert "| S3 | bf16 | median TPOT ms | 5.50 | 5.00 | +10.0% | **WORSE** |" in summary
    assert "| S2 | fp8-kv | median TTFT ms | - | - | - | FAILED |" in summary
    ran.clear()
    servers.clear()
    failing.clear()
    assert sb.main(common) == 0
    assert ran == ["S2/fp8-kv"] and [t for t, _ in servers] == ["fp8-kv"]
    ran.clear()
    assert sb.main([*common, "--only", "S1"]) == 0 and ran == []
    entries = [json.loads(line) for line in (out / "scoreboard.jsonl").read_text().splitlines()]
    assert len(entries) == 7 and all(e["gpu"] == "G" and e["commit"] == "0123456" for e in entries)
    assert entries[0]["metrics"] == {"median TPOT ms": 5.5, "median TTFT ms": 10.0}

    assert sb.main(["--out", str(out), "--report-only", "--record", "--baseline", str(base)]) == 0
    assert ran == []
    recorded = json.loads(base.read_text())["G"]
    assert recorded["S3"]["bf16"]["median TPOT ms"] == {"value": 5.5, "commit": "0123456",
                                                        "date": entries[0]["date"]}
    assert recorded["S1"]["fp8-kv"]["output tok/s"]["value"] == 7000.0
    assert recorded["S2"]["fp8-kv"]["p99 ITL ms"]["value"] == 25.0  # its rerun succeeded
    assert "fp8-both" not in recorded["S1"]


def test_pd_bench_reads_the_kv_transfers_of_a_run_from_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    pd = _load("scenarios/pd_bench")
    lab = 'model_name="m"'

    def scrape(count: int, bounds: list[float], total_s: float, nbytes: int) -> str:
        lines = ["# TYPE tokenspeed:kv_transfer_seconds histogram"]
        for le, c in zip(["0.001", "0.01", "0.1", "+Inf"], [*bounds, count]):
            lines.append(f'tokenspeed:kv_transfer_seconds_bucket{{{lab},le="{le}"}} {c}')
        lines += [f"tokenspeed:kv_transfer_seconds_sum{{{lab}}} {total_s}",
                  f"tokenspeed:kv_transfer_seconds_count{{{lab}}} {count}",
                  f"tokenspeed:kv_transfer_arrived_bytes_total{{{lab}}} {nbytes}"]
        return "\n".join(lines)

    pages = iter([scrape(2, [1, 2, 2], 0.0015, 2_000_000),  # before the run: 2 transfers
                  scrape(102, [1, 52, 101], 0.5015, 102_000_000)])
    monkeypatch.setattr(pd.gpu_bench, "http_get", lambda url, timeout=5.0: (200, next(pages)))
    kv = pd.kv_transfer(pd.read_metrics("u"), pd.read_metrics("u"))
    # 100 transfers of 1 MB in 0.5 s: 5 ms each, 0.2 GB/s; 50 under 10 ms, 49 under 100 ms.
    assert kv["transfers"] == 100
    assert kv["mean_ms"] == pytest.approx(5.0)
    assert kv["mb_per_transfer"] == pytest.approx(1.0)
    assert kv["gb_s"] == pytest.approx(0.2)
    assert kv["p50_ms"] == pytest.approx(10.0)  # the 50th is the last under 10 ms
    assert 10.0 < kv["p99_ms"] <= 100.0
    assert "100 x 1.00 MB" in pd.fmt_kv(kv)
    assert pd.kv_transfer({}, {}) == {"transfers": None}  # a server without the series


def test_trace_bench_reports_each_metric_off_on_and_its_change() -> None:
    """scenarios/trace_bench.py's table (the servers and the sink run on the GPU machine)."""
    tb = _load("scenarios/trace_bench")
    off = {"tracing": False, "metrics": {"S3 median TTFT ms": 20.0, "S2r8 p99 ITL ms": None}, "exports": 0}
    on = {"tracing": True, "metrics": {"S3 median TTFT ms": 21.0, "S2r8 p99 ITL ms": 9.0}, "exports": 7,
          "command": "--enable-trace --otlp-traces-endpoint 127.0.0.1:1"}
    table = tb.report([off, on], "title")
    assert "| S3 median TTFT ms | 20.00 | 21.00 | +5.0% |" in table
    assert "| S2r8 p99 ITL ms | None | 9.00 | - |" in table
    assert "exports received: off 0, on 7" in table
    assert tb.report([off, {"tracing": True, "error": "server failed"}], "t").endswith("server failed")


def test_scoreboard_s1_sends_from_four_client_processes(sb: ModuleType) -> None:
    """S1's ~2,000 streams at once outrun one client event loop (issue 29); S2 and S3 are light."""
    for quick in (False, True):
        wl = sb.workloads(quick=quick)
        assert wl["S1"].args[-2:] == ["--num-client-processes", "4"]
        assert all("--num-client-processes" not in wl[s].args for s in ("S2", "S3"))
