//! Plain-text tables and human units.

/// Renders rows as an aligned table: the first column left-aligned, the others right-aligned,
/// a rule under the header.
pub fn render(header: &[String], rows: &[Vec<String>]) -> String {
    let cols = header.len();
    let mut width = header.iter().map(|h| h.chars().count()).collect::<Vec<_>>();
    for r in rows {
        for (w, cell) in width.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let mut s = String::new();
        for (i, w) in width.iter().enumerate().take(cols) {
            let cell = cells.get(i).map_or("", String::as_str);
            let pad = w.saturating_sub(cell.chars().count());
            if i == 0 {
                s.push_str(cell);
                s.push_str(&" ".repeat(pad));
            } else {
                s.push_str("  ");
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            }
        }
        s.trim_end().to_owned()
    };
    let mut out = line(header);
    out.push('\n');
    out.push_str(&"-".repeat(width.iter().sum::<usize>() + 2 * cols.saturating_sub(1)));
    out.push('\n');
    for r in rows {
        out.push_str(&line(r));
        out.push('\n');
    }
    out
}

/// Bytes in binary units (`512 B`, `1.50 KiB`, `3.25 MiB`, `2.00 GiB`).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

/// Seconds with a unit that keeps three significant digits (`850 µs`, `12.3 ms`, `1.25 s`).
pub fn seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.0} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}
