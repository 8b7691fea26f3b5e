//! The `holdfast` binary end to end: exit codes, the verdict, the plan's JSON, and one clear error
//! line for bad options and configs.

use std::path::PathBuf;
use std::process::{Command, Output};

fn holdfast(args: &[&str]) -> Output {
    let bin = holdfast_hal::testing::workspace_binary(env!("CARGO_BIN_EXE_holdfast"));
    Command::new(&bin).args(args).output().unwrap_or_else(|e| {
        panic!(
            "cannot run {}: {e} (HOLDFAST_BIN_DIR names the folder holding `holdfast` for a test executable run \
             off its build tree)",
            bin.display()
        )
    })
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A fresh directory under the system temp dir, unique to this test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("holdfast-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Exit code 2 and a single `error:` line on stderr that contains every `needle`.
fn assert_usage_error(out: &Output, needles: &[&str]) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    let first = err.lines().next().unwrap_or_default();
    assert!(first.starts_with("error:"), "stderr: {err}");
    for n in needles {
        assert!(first.contains(n), "`{n}` not named in: {first}");
    }
}

#[test]
fn simulate_16_requests_gives_identical_tokens_in_every_mode() {
    let json = temp_dir("simulate").join("report.json");
    let json_arg = json.to_str().expect("utf-8 path");
    let out = holdfast(&["simulate", "--requests", "16", "--quiet", "--json", json_arg]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "stdout: {stdout}\nstderr: {}", text(&out.stderr));
    assert!(stdout.lines().any(|l| l.starts_with("verdict: identical tokens across 5 modes")), "{stdout}");
    for mode in ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"] {
        assert!(stdout.contains(mode), "{mode} missing from the table:\n{stdout}");
    }

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("report written")).expect("report is JSON");
    assert_eq!(report["verdict"]["identical"], true);
    assert_eq!(report["verdict"]["requests"], 16);
    let modes = report["modes"].as_array().expect("modes");
    assert_eq!(modes.len(), 5);
    let digest = &modes[0]["tokens_digest"];
    for m in modes {
        assert_eq!(&m["tokens_digest"], digest, "{}", m["mode"]);
        assert_eq!(m["steps"], modes[0]["steps"], "the same stream gives the same batches");
        assert_eq!(m["recaptures"], 0);
        // The CPU backend runs the attention reference (the portable kernel's arithmetic).
        assert_eq!(m["attention_kernel"], "portable", "{}", m["mode"]);
    }
    assert!(stdout.lines().any(|l| l.starts_with("attention kernel") && l.contains("portable")), "{stdout}");
    let none = &modes[0];
    assert_eq!(none["mode"], "NONE");
    assert_eq!(none["graphs_captured"], 0);
    assert_eq!(none["eager_steps"], none["steps"]);
    let fp = &modes[4];
    assert_eq!(fp["mode"], "FULL_AND_PIECEWISE");
    assert!(fp["full_steps"].as_u64().is_some_and(|n| n > 0), "decode steps replay FULL graphs");
}

#[test]
fn plan_json_for_256_seqs_and_8192_tokens_lists_51_sizes_ending_at_512() {
    let out = holdfast(&["plan", "--json", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192"]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("plan is JSON");
    let sizes: Vec<u64> =
        plan["capture_sizes"].as_array().expect("sizes").iter().filter_map(serde_json::Value::as_u64).collect();
    assert_eq!(sizes.len(), 51);
    assert_eq!(sizes.first(), Some(&1));
    assert_eq!(sizes.last(), Some(&512));
    assert_eq!(plan["resolved_mode"], "FULL_AND_PIECEWISE");
    assert_eq!(plan["keys"]["PIECEWISE"].as_array().map(Vec::len), Some(51));
    assert!(plan["arena_bytes"].as_u64().is_some_and(|b| b > 0));
    assert!(plan["weight_bytes"].as_u64().is_some_and(|b| b > 0));
    assert!(plan["cache_bytes"].as_u64().is_some_and(|b| b > 0));
}

#[test]
fn an_unknown_flag_is_a_usage_error() {
    assert_usage_error(&holdfast(&["simulate", "--bogus-flag"]), &["--bogus-flag"]);
    assert_usage_error(&holdfast(&["plan", "--mode", "fully"]), &["fully"]);
}

#[test]
fn a_malformed_config_file_is_a_usage_error_naming_it() {
    let dir = temp_dir("config");
    let truncated = dir.join("truncated.json");
    std::fs::write(&truncated, "{\"hidden_size\": 64,").expect("write config");
    let path = truncated.to_str().expect("utf-8 path");
    assert_usage_error(&holdfast(&["plan", "--config", path]), &["config.json", path]);

    let mut cfg: serde_json::Value =
        serde_json::from_str(&holdfast_model::ModelConfig::tiny().to_json()).expect("json");
    cfg["hc_mult"] = 3.into();
    let inconsistent = dir.join("hc_mult.json");
    std::fs::write(&inconsistent, cfg.to_string()).expect("write config");
    let path = inconsistent.to_str().expect("utf-8 path");
    assert_usage_error(&holdfast(&["simulate", "--config", path, "--requests", "1"]), &["hc_mult", path]);
}

#[test]
fn an_impossible_capture_size_is_a_usage_error() {
    assert_usage_error(
        &holdfast(&["plan", "--max-num-batched-tokens", "64", "--capture-sizes", "1,2,4096"]),
        &["capture_sizes", "4096"],
    );
    assert_usage_error(&holdfast(&["simulate", "--capture-sizes", "0", "--quiet"]), &["capture_sizes"]);
    // The same list is checked the same way where no graph is captured.
    assert_usage_error(&holdfast(&["plan", "--mode", "none", "--capture-sizes", "0"]), &["capture_sizes", "size 0"]);
    assert_usage_error(&holdfast(&["plan", "--mode", "none", "--capture-sizes", "999"]), &["capture_sizes", "999"]);
    // Every mode's settings are checked before the first mode runs: without --quiet the error is
    // still the first line (no header, no NONE run before the graph modes' capture sizes fail).
    for (args, named) in [
        (&["simulate", "--capture-sizes", "0"][..], "capture_sizes"),
        (&["simulate", "--max-capture-size", "0"][..], "max_cudagraph_capture_size"),
        (&["simulate", "--max-num-seqs", "0"][..], "--max-num-seqs"),
        (&["simulate", "--modes", "none,full", "--capture-sizes", "1,4096"][..], "4096"),
    ] {
        let out = holdfast(args);
        assert_usage_error(&out, &[named]);
        assert!(text(&out.stdout).is_empty(), "{args:?}: nothing ran: {}", text(&out.stdout));
    }
}

#[test]
fn an_unusable_backend_or_workload_is_a_usage_error() {
    assert_usage_error(&holdfast(&["plan", "--backend", "tpu:0"]), &["tpu:0"]);
    assert_usage_error(
        &holdfast(&["simulate", "--prompt-len", "500", "--max-model-len", "256", "--quiet"]),
        &["--max-model-len"],
    );
}

#[test]
fn tokens_do_not_depend_on_arrivals_concurrency_or_token_budget() {
    let dir = temp_dir("arrivals");
    let runs: [&[&str]; 2] = [
        &["--modes", "none", "--arrival-rate", "0", "--concurrency", "1"],
        &["--modes", "full_and_piecewise", "--arrival-rate", "4", "--max-num-batched-tokens", "48"],
    ];
    let digests: Vec<serde_json::Value> = runs
        .iter()
        .enumerate()
        .map(|(i, extra)| {
            let json = dir.join(format!("run{i}.json"));
            let mut args = vec!["simulate", "--requests", "8", "--quiet", "--json", json.to_str().expect("utf-8 path")];
            args.extend_from_slice(extra);
            let out = holdfast(&args);
            assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
            let report: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&json).expect("report")).expect("JSON");
            report["modes"][0]["tokens_digest"].clone()
        })
        .collect();
    assert_eq!(digests[0], digests[1]);
}

#[test]
fn tensor_parallel_ranks_give_the_single_device_tokens_and_bad_splits_are_usage_errors() {
    let dir = temp_dir("tp");
    let digests_on = |tp: &str, backend: &str| -> Vec<serde_json::Value> {
        let json = dir.join(format!("tp{tp}.json"));
        let out = holdfast(&[
            "simulate",
            "--requests",
            "8",
            "--quiet",
            "--modes",
            "none,full_and_piecewise",
            "--tensor-parallel",
            tp,
            "--backend",
            backend,
            "--json",
            json.to_str().expect("utf-8 path"),
        ]);
        assert_eq!(out.status.code(), Some(0), "tp {tp} on {backend}: {}", text(&out.stderr));
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).expect("report written")).expect("JSON");
        report["modes"].as_array().expect("modes").iter().map(|m| m["tokens_digest"].clone()).collect()
    };
    let digests = |tp: &str| digests_on(tp, "cpu");
    let (one, two) = (digests("1"), digests("2"));
    assert_eq!(one.len(), 2);
    assert_eq!(one[0], one[1], "modes agree on one device");
    assert_eq!(two, one, "2 ranks generate the single-device tokens");
    // Every spelling of the CPU device serves every rank.
    assert_eq!(digests_on("2", "cpu:0"), one, "cpu:0");
    assert_eq!(digests_on("2", "CPU"), one, "CPU");
    // `tiny` has 2 query heads: 4 ranks cannot split them.
    assert_usage_error(&holdfast(&["simulate", "--tensor-parallel", "4"]), &["num_attention_heads", "4"]);
    assert_usage_error(&holdfast(&["simulate", "--tensor-parallel", "0"]), &["--tensor-parallel"]);
    // A rank count the model cannot split is refused before any device opens (at once).
    let t0 = std::time::Instant::now();
    assert_usage_error(&holdfast(&["simulate", "--tensor-parallel", "3000000"]), &["3000000"]);
    assert!(t0.elapsed().as_secs() < 30, "refused before opening 3 000 000 devices");
}

#[test]
fn sizes_past_the_arithmetic_are_usage_errors_not_crashes() {
    // Lengths whose sum overflows, and more requests than a simulation holds.
    let huge = u64::MAX.to_string();
    assert_usage_error(
        &holdfast(&["simulate", "--prompt-len", &huge, "--output-len", "1", "--quiet"]),
        &["--max-model-len", "more than 2^64"],
    );
    assert_usage_error(&holdfast(&["simulate", "--requests", "1000000000000", "--quiet"]), &["--requests"]);
    // Config sizes past their bounds name the field (no allocation is attempted).
    let dir = temp_dir("huge");
    for (field, value) in [
        ("hidden_size", serde_json::Value::from(1u64 << 40)),
        ("num_attention_heads", serde_json::Value::from(1u64 << 58)),
        ("hc_sinkhorn_iters", serde_json::Value::from(1u64 << 40)),
        ("max_position_embeddings", serde_json::Value::from(1u64 << 62)),
    ] {
        let mut cfg: serde_json::Value =
            serde_json::from_str(&holdfast_model::ModelConfig::tiny().to_json()).expect("json");
        cfg[field] = value;
        let path = dir.join(format!("{field}.json"));
        std::fs::write(&path, cfg.to_string()).expect("write config");
        let path = path.to_str().expect("utf-8 path");
        assert_usage_error(&holdfast(&["plan", "--config", path]), &[field, "at most"]);
    }
}

#[test]
fn an_unwritable_json_path_is_a_usage_error_before_any_mode_runs() {
    let path = std::env::temp_dir().join(format!("holdfast-no-such-dir-{}", std::process::id())).join("r.json");
    let p = path.to_str().expect("utf-8 path");
    let out = holdfast(&["simulate", "--requests", "2", "--json", p]);
    assert_usage_error(&out, &["--json", p]);
    assert!(text(&out.stdout).is_empty(), "nothing ran: {}", text(&out.stdout));
    // A run refused after the path was checked leaves no report file behind.
    let json = temp_dir("refused").join("r.json");
    let out = holdfast(&["simulate", "--quiet", "--max-model-len", "99999", "--json", json.to_str().expect("utf-8")]);
    assert_usage_error(&out, &["max_model_len", "99999"]);
    assert!(!json.exists(), "no empty report left at {}", json.display());
}

#[test]
fn a_capture_maximum_the_rules_change_is_reported() {
    let out = holdfast(&["plan", "--max-capture-size", "1000"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("note: ") && err.contains("from 1000 to 128"), "stderr: {err}");
    let out =
        holdfast(&["simulate", "--quiet", "--requests", "2", "--modes", "none,full", "--max-capture-size", "1000"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("note: FULL: ") && err.contains("from 1000 to 128"), "stderr: {err}");
    // Sizes the rules keep as given draw no note.
    let out = holdfast(&["plan", "--capture-sizes", "1,2,4"]);
    assert!(!text(&out.stderr).contains("note:"), "stderr: {}", text(&out.stderr));
}
