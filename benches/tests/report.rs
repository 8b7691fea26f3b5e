//! The report's library entry on the CPU backend in quick mode, and its exit codes.

use holdfast_benches::{run, Options, Section};

#[test]
fn quick_cpu_report_has_finite_positive_times() {
    let opts = Options {
        device: "cpu".into(),
        quick: true,
        only: vec![Section::Hal, Section::Mhc],
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

#[test]
fn an_unknown_device_exits_with_code_2() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-report"))
        .args(["--device", "tpu:0", "--quick"])
        .output()
        .unwrap_or_else(|e| panic!("spawn: {e}"));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error:"), "{err}");
}

#[test]
fn an_unknown_section_exits_with_code_2() {
    assert_eq!(holdfast_benches::main_with_args(["gpu-report", "--only", "nope"].map(String::from)), 2);
}
