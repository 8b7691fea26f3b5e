//! The report's library entry on the CPU backend in quick mode, and its exit codes.

use holdfast_benches::{run, Options, Section};

#[test]
fn quick_cpu_report_has_finite_positive_times() {
    let opts = Options {
        device: "cpu".into(),
        quick: true,
        only: vec![Section::Hal, Section::Mhc],
        cases: Vec::new(),
        torch: None,
        verbose: false,
    };
    let report = match run(&opts) {
        Ok(r) => r,
        Err(e) => panic!("report: {e}"),
    };
    assert!(report.failed.is_empty(), "{:?}", report.notes);
    let json = match serde_json::to_value(&report) {
        Ok(v) => v,
        Err(e) => panic!("json: {e}"),
    };
    let rows = json["rows"].as_array().cloned().unwrap_or_default();
    let timed: Vec<f64> = rows.iter().filter_map(|r| r["time_us"].as_f64()).collect();
    assert!(timed.len() >= 10, "{} timed rows", timed.len());
    assert!(timed.iter().all(|t| t.is_finite() && *t > 0.0), "{timed:?}");
    for section in ["ceilings", "hal", "mhc"] {
        assert!(rows.iter().any(|r| r["section"] == section), "no {section} rows");
    }
    // Every mHC row carries its bytes and a bandwidth.
    for r in rows.iter().filter(|r| r["section"] == "mhc") {
        assert!(r["bytes"].as_u64().is_some_and(|b| b > 0), "{r}");
        assert!(r["gbps"].as_f64().is_some_and(|g| g.is_finite() && g > 0.0), "{r}");
    }
    assert!(report.table().lines().count() >= rows.len() + 2);
}

/// `--cases` runs only the rows whose case contains one of its pieces (the copy ceiling always),
/// and says so; a piece no row matches leaves a note instead of a silent empty report.
#[test]
fn cases_limit_the_rows_and_an_unmatched_case_is_noted() {
    let opts = |cases: &[&str]| Options {
        device: "cpu".into(),
        quick: true,
        only: vec![Section::Attention, Section::Mhc],
        cases: cases.iter().map(|c| c.to_string()).collect(),
        torch: None,
        verbose: false,
    };
    let report = run(&opts(&["T=8", "B=4"])).unwrap_or_else(|e| panic!("report: {e}"));
    assert!(report.failed.is_empty(), "{:?}", report.notes);
    let rows: Vec<_> = report.rows.iter().filter(|r| r.section != "ceilings").collect();
    assert!(rows.iter().any(|r| r.section == "mhc") && rows.iter().any(|r| r.section == "attention"), "{rows:?}");
    for r in &rows {
        assert!(r.case.contains("T=8") || r.case.contains("B=4"), "{}/{} ran", r.section, r.case);
    }
    assert!(report.rows.iter().any(|r| r.section == "ceilings"), "the copy ceiling always runs");
    assert!(report.notes.iter().any(|n| n.contains("rows limited") && n.contains("T=8 | B=4")), "{:?}", report.notes);

    let report = run(&opts(&["no such case"])).unwrap_or_else(|e| panic!("report: {e}"));
    assert!(report.rows.iter().all(|r| r.section == "ceilings"), "{:?}", report.rows);
    assert!(report.notes.iter().any(|n| n.contains("no row of sections attention,mhc")), "{:?}", report.notes);
}

#[test]
fn an_unknown_device_exits_with_code_2() {
    let bin = holdfast_hal::testing::workspace_binary(env!("CARGO_BIN_EXE_gpu-report"));
    let out = std::process::Command::new(&bin)
        .args(["--device", "tpu:0", "--quick"])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e} (set HOLDFAST_BIN_DIR off the build tree)", bin.display()));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error:"), "{err}");
}

#[test]
fn an_unknown_section_exits_with_code_2() {
    assert_eq!(holdfast_benches::main_with_args(["gpu-report", "--only", "nope"].map(String::from)), 2);
}

#[test]
fn an_unreadable_torch_file_or_unwritable_json_path_exits_with_code_2_before_the_run() {
    let missing = std::env::temp_dir().join(format!("holdfast-no-such-dir-{}", std::process::id()));
    let torch = missing.join("torch.json");
    let json = missing.join("report.json");
    // Both are refused before any section runs (a full report would take minutes; these return
    // at once).
    let t0 = std::time::Instant::now();
    let args =
        |extra: [&str; 2]| ["gpu-report", "--quick", "--only", "hal", extra[0], extra[1]].map(String::from).to_vec();
    assert_eq!(holdfast_benches::main_with_args(args(["--torch", torch.to_str().unwrap_or("?")])), 2);
    assert_eq!(holdfast_benches::main_with_args(args(["--json", json.to_str().unwrap_or("?")])), 2);
    assert!(t0.elapsed().as_secs() < 5, "refused before the run");
}
