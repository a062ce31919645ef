"""Speculative decoding settings: NGRAM, EAGLE3 and NEXTN are on, vLLM's --speculative-config
maps onto the same flags, the other algorithms (and EAGLE tree drafting, NEXTN past one rank or
on a model without an MTP layer) refuse clearly, and the overlap scheduler stays as configured
(the engine overlaps only while speculation is paused)."""

from __future__ import annotations

import pytest

from tokenspeed.config import ConfigError, NotSupportedError, parse_serve_args


def test_ngram_flags_reach_the_scheduler_and_keep_overlap() -> None:
    cfg = parse_serve_args(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                            "5", "--speculative-ngram-max-match-window-size", "6"])
    sched = cfg.section("scheduler")
    assert sched["speculative_algorithm"] == "NGRAM"
    assert sched["speculative_num_draft_tokens"] == 5
    assert sched["speculative_ngram_min_match_window_size"] == 1
    assert sched["speculative_ngram_max_match_window_size"] == 6
    assert cfg.worker_dict()["speculative_num_draft_tokens"] == 5
    assert cfg.disable_overlap_schedule is False
    off = parse_serve_args(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                            "5", "--disable-overlap-schedule"])
    assert off.disable_overlap_schedule is True  # the user's choice stays
    plain = parse_serve_args([])
    assert plain.speculative_algorithm is None and plain.disable_overlap_schedule is False


def test_vllm_speculative_config_maps_onto_the_flags() -> None:
    cfg = parse_serve_args(["--speculative-config", ('{"method": "ngram", "num_speculative_tokens"'
                            ': 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}')])
    assert (cfg.speculative_algorithm, cfg.speculative_num_draft_tokens) == ("NGRAM", 3)
    assert cfg.speculative_ngram_min_match_window_size == 2
    assert cfg.speculative_ngram_max_match_window_size == 5
    assert cfg.disable_overlap_schedule is False
    assert "speculative_config" not in cfg.server_dict()  # read by the launcher alone


@pytest.mark.parametrize("algorithm", ["EAGLE", "STANDALONE"])
def test_algorithms_with_draft_weights_refuse(algorithm: str) -> None:
    with pytest.raises(NotSupportedError, match="available now: NGRAM, EAGLE3, NEXTN"):
        parse_serve_args(["--speculative-algorithm", algorithm,
                          "--speculative-num-draft-tokens", "4"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--speculative-algorithm", "NGRAM"], "needs --speculative-num-draft-tokens"),
    (["--speculative-num-draft-tokens", "4"], "needs --speculative-algorithm"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
      "--speculative-ngram-min-match-window-size", "5",
      "--speculative-ngram-max-match-window-size", "3"], "is larger than"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
     "positive integer"),
    (["--speculative-config", '{"method": "ngram", "model": "x"}'], "model .a path. is for method eagle3"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3"],
     "needs --speculative-draft-model-path"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "h"],
     "needs --speculative-num-steps or --speculative-num-draft-tokens"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "h",
      "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "6"], "give 3 or"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
      "--speculative-num-steps", "3"], "are for --speculative-algorithm EAGLE3 or NEXTN"),
    (["--speculative-draft-model-path", "h"], "needs --speculative-algorithm"),
    # The gate's tuning away from its defaults asks for speculation too (at them: neutral).
    (["--speculative-disable-by-batch-size", "8"], "disable-by-batch-size needs --speculative-algorithm"),
    (["--speculative-break-even-accept-length", "0"], "accept-length needs --speculative-algorithm"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
      "--speculative-num-draft-tokens", "4"], "but the flag says 4"),
    (["--speculative-config", "[1]"], "must be a JSON object"),
])
def test_inconsistent_settings_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_serve_args(argv)


def test_eagle_in_vllm_config_refuses() -> None:
    with pytest.raises(NotSupportedError, match="^not supported yet: --speculative-config"):
        parse_serve_args(["--speculative-config", ('{"method": "eagle", '
                          '"num_speculative_tokens": 3}')])


@pytest.mark.parametrize("argv", [
    # SGLang's spelling: the draft-token count includes the verified token.
    ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/h",
     "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
     "--speculative-num-draft-tokens", "4"],
    ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/h",
     "--speculative-num-draft-tokens", "3"],
    ["--speculative-config", '{"method": "eagle3", "model": "/h", "num_speculative_tokens": 3}'],
])
def test_eagle3_settings_reach_the_scheduler_and_worker(argv: list[str]) -> None:
    cfg = parse_serve_args(argv)
    sched, worker = cfg.section("scheduler"), cfg.worker_dict()
    assert (sched["speculative_algorithm"], sched["speculative_num_draft_tokens"]) == ("EAGLE3", 3)
    assert (worker["speculative_draft_model_path"], worker["speculative_num_steps"]) == ("/h", 3)
    assert cfg.disable_overlap_schedule is False


def test_eagle_tree_drafting_refuses() -> None:
    with pytest.raises(NotSupportedError, match="speculative-eagle-topk"):
        parse_serve_args(["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                          "/h", "--speculative-num-steps", "3", "--speculative-eagle-topk", "4"])


@pytest.mark.parametrize("argv", [
    # SGLang's spelling (the draft path defaults to the model's own checkpoint).
    ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
    ["--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "3"],
    # vLLM's: DeepSeek's MTP layer under either method name.
    ["--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 3}'],
    ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}'],
])
def test_nextn_settings_reach_the_scheduler_and_worker(argv: list[str]) -> None:
    cfg = parse_serve_args(argv)
    sched, worker = cfg.section("scheduler"), cfg.worker_dict()
    assert (sched["speculative_algorithm"], sched["speculative_num_draft_tokens"]) == ("NEXTN", 3)
    assert (worker["speculative_draft_model_path"], worker["speculative_num_steps"]) == (None, 3)
    assert cfg.disable_overlap_schedule is False


def test_nextn_takes_a_separate_mtp_checkpoint() -> None:
    cfg = parse_serve_args(["--speculative-config",
                            '{"method": "mtp", "model": "/mtp", "num_speculative_tokens": 2}'])
    assert (cfg.speculative_algorithm, cfg.speculative_draft_model_path) == ("NEXTN", "/mtp")


@pytest.mark.parametrize(("argv", "message"), [
    (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
      "--speculative-eagle-topk", "2"], "speculative-eagle-topk"),
    (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--tp-size", "2",
      "--nnodes", "2"], "NEXTN with --nnodes 2"),
])
def test_nextn_refuses_what_it_cannot_do(argv: list[str], message: str) -> None:
    with pytest.raises(NotSupportedError, match=message):
        parse_serve_args(argv)


@pytest.mark.parametrize("parallel", [["--tp-size", "2"], ["--tp-size", "2", "--ep-size", "2"],
                                      ["--tp", "2", "--dp", "2", "--enable-dp-attention",
                                       "--ep-size", "2"]])
def test_nextn_runs_on_several_ranks_of_one_node(parallel: list[str]) -> None:
    # The MTP layer is sharded as the target's layers (tests/test_nextn_parallel.py,
    # tests/test_e2e_nextn_parallel.py).
    cfg = parse_serve_args(["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
                            *parallel])
    assert cfg.speculative_algorithm == "NEXTN"


def test_nextn_needs_a_chain_length() -> None:
    with pytest.raises(ConfigError, match="NEXTN needs --speculative-num-steps"):
        parse_serve_args(["--speculative-algorithm", "NEXTN"])


def test_a_model_without_an_mtp_layer_is_refused_at_start(tmp_path) -> None:
    import json

    from tokenspeed.launch.model_facts import checkpoint_refusal

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"],
                                                      "num_nextn_predict_layers": 0}))
    nextn = parse_serve_args(["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"])
    assert "not supported yet: --speculative-algorithm NEXTN" in checkpoint_refusal(nextn, tmp_path)
    assert checkpoint_refusal(parse_serve_args([]), tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"num_nextn_predict_layers": 1}))
    assert checkpoint_refusal(nextn, tmp_path) is None


def test_the_speculation_gate_settings_reach_the_scheduler() -> None:
    ngram = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "3"]
    sched = parse_serve_args(ngram).section("scheduler")
    assert (sched["speculative_disable_by_batch_size"], sched["speculative_break_even_accept_length"],
            sched["speculative_break_even_per_request"], sched["speculative_probe_interval"]) == \
        (32, 1.7, 0.04, 64)
    sched = parse_serve_args([*ngram, "--speculative-disable-by-batch-size", "0",
                              "--speculative-break-even-accept-length", "0",
                              "--speculative-probe-interval", "5"]).section("scheduler")
    assert (sched["speculative_disable_by_batch_size"], sched["speculative_break_even_accept_length"],
            sched["speculative_probe_interval"]) == (0, 0.0, 5)
    # vLLM's spelling.
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}'
    cfg = parse_serve_args(["--speculative-config", spec])
    assert cfg.section("scheduler")["speculative_disable_by_batch_size"] == 4


_NGRAM3 = '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": '


@pytest.mark.parametrize(("argv", "message"), [
    (["--speculative-config", _NGRAM3 + "0}"], "disable_by_batch_size must be a positive integer"),
    (["--speculative-config", _NGRAM3 + "true}"], "disable_by_batch_size must be a positive integer"),
    (["--speculative-break-even-accept-length", "-1"], "speculative-break-even-accept-length"),
    (["--speculative-break-even-per-request", "-0.5"], "speculative-break-even-per-request"),
    (["--speculative-probe-interval", "0"], "speculative-probe-interval"),
    (["--speculative-disable-by-batch-size", "-2"], "speculative-disable-by-batch-size"),
])
def test_bad_speculation_gate_settings_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_serve_args(argv)


def test_the_gates_defaults_spelled_out_pass_without_speculation() -> None:
    cfg = parse_serve_args(["--speculative-disable-by-batch-size", "32",
                            "--speculative-probe-interval", "64"])
    assert cfg.speculative_algorithm is None
