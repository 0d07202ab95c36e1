//! The pressure report as a person reads it: a terminal summary and a self-contained HTML page
//! (inline SVG plots, no scripts, nothing fetched) from the same [`Report`].

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::pressure::{Marker, Report};

const COLORS: [&str; 6] = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn ms(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.0}")
    } else {
        "–".into()
    }
}

/// A line chart of several series over one x axis, with numbered vertical markers.
fn line_chart(title: &str, y_label: &str, series: &[(&str, Vec<(f64, f64)>)], markers: &[Marker], x_max: f64) -> String {
    let (w, h, left, right, top, bottom) = (900.0, 270.0, 60.0, 20.0, 44.0, 36.0);
    let y_max = series.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y)).fold(0.0f64, f64::max).max(1.0) * 1.1;
    let x_max = x_max.max(1.0);
    let x = |v: f64| left + (w - left - right) * v / x_max;
    let y = |v: f64| top + (h - top - bottom) * (1.0 - v / y_max);
    let mut svg = format!(r#"<svg viewBox="0 0 {w} {h}" width="100%" role="img" aria-label="{t}"><text x="{left}" y="16" class="title">{t}</text>"#, t = esc(title));
    let y_digits = if y_max < 10.0 { 1 } else { 0 };
    for i in 0..=4 {
        let v = y_max * i as f64 / 4.0;
        let _ = write!(svg, r#"<line x1="{left}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" class="grid"/><text x="{}" y="{:.1}" class="tick" text-anchor="end">{v:.y_digits$}</text>"#, w - right, left - 6.0, y(v) + 4.0, yy = y(v));
    }
    for i in 0..=6 {
        let v = x_max * i as f64 / 6.0;
        let label = if x_max < 10_000.0 { format!("{v:.0} ms") } else { format!("{:.0} s", v / 1000.0) };
        let _ = write!(svg, r#"<text x="{:.1}" y="{}" class="tick" text-anchor="middle">{label}</text>"#, x(v), h - 18.0);
    }
    let _ = write!(svg, r#"<text x="14" y="{:.1}" class="tick" transform="rotate(-90 14 {:.1})" text-anchor="middle">{}</text>"#, h / 2.0, h / 2.0, esc(y_label));
    for (n, m) in markers.iter().enumerate() {
        // Numbers in three staggered rows so that close markers stay readable.
        let _ = write!(svg, r##"<line x1="{xx:.1}" x2="{xx:.1}" y1="{top}" y2="{}" class="marker"/><text x="{xx:.1}" y="{}" class="mlabel" text-anchor="middle">{}</text>"##, h - bottom, top + 9.0 + 10.0 * (n % 3) as f64, n + 1, xx = x(m.at_ms));
    }
    let mut legend_x = left;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = points.iter().map(|(px, py)| format!("{:.1},{:.1}", x(*px), y(*py))).collect();
        if !path.is_empty() {
            let _ = write!(svg, r#"<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{}"/>"#, path.join(" "));
        }
        let _ = write!(svg, r#"<rect x="{legend_x}" y="29" width="12" height="3" fill="{color}"/><text x="{}" y="34" class="tick">{}</text>"#, legend_x + 16.0, esc(name));
        legend_x += 30.0 + 7.0 * name.len() as f64;
    }
    svg.push_str("</svg>");
    svg
}

/// Empirical CDFs of latency, one line per device.
fn cdf_chart(series: &BTreeMap<String, Vec<f64>>) -> String {
    let points: Vec<(&str, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(name, values)| {
            let mut v = values.clone();
            v.sort_by(f64::total_cmp);
            let n = v.len() as f64;
            let mut steps = Vec::new();
            for (i, l) in v.iter().enumerate() {
                steps.push((*l, i as f64 / n * 100.0));
                steps.push((*l, (i + 1) as f64 / n * 100.0));
            }
            (name.as_str(), steps)
        })
        .collect();
    let x_max = series.values().flatten().cloned().fold(0.0, f64::max) * 1.05;
    line_chart("Latency CDF by device (x: latency, y: % of completed requests)", "% of requests", &points, &[], x_max)
}

pub fn html(report: &Report) -> String {
    let x_max = report.wall_s * 1000.0;
    let pick = |f: &dyn Fn(&crate::pressure::Sample) -> Option<f64>| -> Vec<(f64, f64)> { report.samples.iter().filter_map(|s| f(s).map(|v| (s.at_ms, v))).collect() };
    let vram = line_chart(
        "GPU memory (MiB) with faults",
        "MiB",
        &[
            ("capacity", pick(&|s| s.vram_capacity_mib)),
            ("in use", pick(&|s| s.vram_used_mib)),
            ("reserved by requests", pick(&|s| s.vram_reserved_mib)),
            ("competing program", pick(&|s| s.vram_competing_mib)),
            ("reserve line (capacity − reserve)", report.sizing.as_ref().and_then(|z| z["reserve_mib"].as_f64()).map(|r| pick(&|s| s.vram_capacity_mib.map(|c| c - r))).unwrap_or_default()),
        ],
        &report.markers,
        x_max,
    );
    let budget = report.host_ram["budget_mib"].as_f64().unwrap_or(0.0);
    let host = line_chart(
        "Host RAM (MiB)",
        "MiB",
        &[
            ("in use (machine)", pick(&|s| s.host_used_mib)),
            ("Headroom processes", pick(&|s| s.headroom_rss_mib)),
            ("budget", report.samples.iter().map(|s| (s.at_ms, budget)).collect()),
        ],
        &report.markers,
        x_max,
    );
    let queue = line_chart("Requests waiting", "requests", &[("waiting", pick(&|s| s.queue_waiting.map(|q| q as f64)))], &report.markers, x_max);
    let mut by_device: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in report.records.iter().filter(|r| r.completed) {
        by_device.entry(r.device.clone().unwrap_or_default()).or_default().push(r.latency_ms);
    }
    let cdf = cdf_chart(&by_device);

    let mut page = String::new();
    let verdict = if report.passed { "PASSED" } else { "FAILED" };
    let _ = write!(
        page,
        r#"<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Headroom pressure report</title><style>
body{{font:14px system-ui,sans-serif;margin:24px;max-width:1100px;color:#111}} table{{border-collapse:collapse;margin:8px 0 20px;font-size:12px}} td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}} th{{background:#f3f4f6}} td:first-child,th:first-child{{text-align:left}}
.pass{{color:#15803d;font-weight:600}} .fail{{color:#b91c1c;font-weight:600}} svg{{background:#fff;border:1px solid #e5e7eb;margin:6px 0}} .grid{{stroke:#e5e7eb}} .tick{{font-size:11px;fill:#374151}} .title{{font-size:13px;font-weight:600}} .marker{{stroke:#f59e0b;stroke-dasharray:3 3}} .mlabel{{font-size:10px;fill:#b45309}} ol.markers{{columns:2;font-size:12px}}
</style></head><body><h1>Headroom pressure report: <span class="{}">{verdict}</span></h1>
<p>Profile <b>{:?}</b> on <b>{:?}</b>, model <b>{}</b>, {:.0} s wall. Every figure below was measured in this run by real HTTP clients against a real <code>headroom serve</code> and its worker processes.</p>"#,
        if report.passed { "pass" } else { "fail" },
        report.profile,
        report.gpu,
        esc(&report.model),
        report.wall_s
    );
    page.push_str("<h2>Pass criteria</h2><table><tr><th>criterion</th><th>result</th><th>detail</th></tr>");
    for c in &report.criteria {
        let _ = write!(page, r#"<tr><td>{}</td><td class="{}">{}</td><td style="text-align:left">{}</td></tr>"#, esc(&c.name), if c.passed { "pass" } else { "fail" }, if c.passed { "pass" } else { "FAIL" }, esc(&c.detail));
    }
    page.push_str("</table><h2>Outcomes by scenario</h2><table><tr><th>scenario</th><th>stream</th><th>sent</th><th>accep&shy;ted</th><th>comp&shy;leted</th><th>refused</th><th>cancelled by client</th><th>lost</th><th>success</th><th>on GPU</th><th>on CPU</th><th>fail&shy;overs</th><th>degraded (unmarked)</th><th>p50 ms</th><th>p95 ms</th><th>max queued ms</th></tr>");
    for s in &report.scenarios {
        let _ = write!(
            page,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0}%</td><td>{}</td><td>{}</td><td>{}</td><td>{} ({})</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&s.scenario), if s.stream { "on" } else { "off" }, s.sent, s.accepted, s.completed, s.refused, s.cancelled_by_client, s.lost, s.success_rate * 100.0, s.on_gpu, s.on_cpu, s.failovers, s.degraded, s.degraded_unmarked, ms(s.p50_latency_ms), ms(s.p95_latency_ms), ms(s.max_queued_ms)
        );
    }
    page.push_str("</table><h2>Memory over time</h2>");
    page.push_str(&vram);
    page.push_str(&host);
    page.push_str(&queue);
    page.push_str("<ol class=\"markers\">");
    for m in &report.markers {
        let _ = write!(page, "<li>{:.1} s: {}</li>", m.at_ms / 1000.0, esc(&m.label));
    }
    page.push_str("</ol><h2>Latency</h2>");
    page.push_str(&cdf);
    page.push_str("<table><tr><th>class</th><th>device</th><th>requests</th><th>p50 ms</th><th>p95 ms</th></tr>");
    for l in &report.latency_by_class {
        let _ = write!(page, "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", esc(l["class"].as_str().unwrap_or("")), esc(l["device"].as_str().unwrap_or("")), l["count"], ms(l["p50_ms"].as_f64().unwrap_or(f64::NAN)), ms(l["p95_ms"].as_f64().unwrap_or(f64::NAN)));
    }
    let e = &report.equivalence;
    let _ = write!(page, "</table><h2>Token equivalence (greedy, GPU vs CPU)</h2><p>{} of {} CPU-served or failed-over answers identical to the GPU's answer to the same request ({:.1}%).", e.identical, e.compared, e.identical_percent);
    if !e.divergences.is_empty() {
        let list: Vec<String> = e.divergences.iter().map(|(p, at)| format!("{} at character {at}", esc(p))).collect();
        let _ = write!(page, " First divergences: {}.", list.join(", "));
    }
    page.push_str("</p><h2>GPU recovery</h2><table><tr><th>fault</th><th>stream</th><th>restored</th><th>ms from fault to ready</th></tr>");
    for r in &report.recoveries {
        let _ = write!(page, "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", esc(&r.fault), r.stream, r.restored, r.recovery_ms.map(ms).unwrap_or("–".into()));
    }
    let spans: Vec<String> = report.breaker_open_ms.iter().map(|v| format!("{v:.0}")).collect();
    let _ = write!(page, "</table><p>Breaker open → closed (ms), from the service's events: {}.</p>", if spans.is_empty() { "never opened".to_string() } else { spans.join(", ") });
    page.push_str("<h2>Requests that failed over</h2><table><tr><th>request</th><th>scenario</th><th>stream</th><th>first failure ms</th><th>decision</th><th>CPU start ms</th><th>served by</th><th>completed</th></tr>");
    for f in &report.failed_requests {
        let num = |k: &str| f[k].as_f64().map(ms).unwrap_or("–".into());
        let _ = write!(page, "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", esc(f["request_id"].as_str().unwrap_or("")), esc(f["scenario"].as_str().unwrap_or("")), f["stream"], num("first_failure_ms"), esc(f["retry_decision"].as_str().unwrap_or("–")), num("cpu_start_ms"), esc(f["device"].as_str().unwrap_or("")), f["completed"]);
    }
    let a = &report.agent;
    let _ = write!(
        page,
        "</table><h2>Agent with a side-effecting tool</h2><p>{} tasks: {} ran their tool exactly once, {} duplicate side effects, {} lost calls, {} retries with the same Idempotency-Key; {} tool calls recorded in the journal before delivery.</p>",
        a.tasks, a.exactly_once, a.duplicate_side_effects, a.lost_calls, a.retries, a.tool_calls_journaled
    );
    let _ = write!(page, "<h2>Profiles</h2><pre>{}</pre>", esc(&serde_json::to_string_pretty(&report.profiles).unwrap_or_default()));
    page.push_str("</body></html>\n");
    page
}

/// What the terminal shows at the end of a run.
pub fn text_summary(report: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "headroom pressure --profile {:?} --gpu {:?}: {} in {:.0} s", report.profile, report.gpu, if report.passed { "PASSED" } else { "FAILED" }, report.wall_s);
    let _ = writeln!(s, "{:<24} {:>6} {:>5} {:>5} {:>5} {:>5} {:>5} {:>5} {:>8} {:>8}", "scenario", "stream", "sent", "done", "lost", "gpu", "cpu", "fo", "p50 ms", "p95 ms");
    for c in &report.scenarios {
        let _ = writeln!(s, "{:<24} {:>6} {:>5} {:>5} {:>5} {:>5} {:>5} {:>5} {:>8} {:>8}", c.scenario, if c.stream { "on" } else { "off" }, c.sent, c.completed, c.lost, c.on_gpu, c.on_cpu, c.failovers, ms(c.p50_latency_ms), ms(c.p95_latency_ms));
    }
    let e = &report.equivalence;
    let _ = writeln!(s, "token equivalence: {}/{} identical ({:.1}%)", e.identical, e.compared, e.identical_percent);
    let rec: Vec<String> = report.recoveries.iter().map(|r| format!("{}{}: {}", r.fault, if r.stream { "/stream" } else { "" }, r.recovery_ms.map(|v| format!("{v:.0} ms")).unwrap_or("NOT restored".into()))).collect();
    let _ = writeln!(s, "GPU recovery (fault → worker ready, breaker closed): {}", rec.join(", "));
    let spans: Vec<String> = report.breaker_open_ms.iter().map(|v| format!("{v:.0}")).collect();
    let _ = writeln!(s, "breaker open → closed ms: [{}]", spans.join(", "));
    let _ = writeln!(s, "queue age ms: p50 {} p95 {} max {}", ms(report.queue_age_ms["p50"].as_f64().unwrap_or(f64::NAN)), ms(report.queue_age_ms["p95"].as_f64().unwrap_or(f64::NAN)), ms(report.queue_age_ms["max"].as_f64().unwrap_or(f64::NAN)));
    for c in &report.criteria {
        let _ = writeln!(s, "[{}] {}: {}", if c.passed { "pass" } else { "FAIL" }, c.name, c.detail);
    }
    let passed = report.criteria.iter().filter(|c| c.passed).count();
    let _ = writeln!(s, "criteria: {passed} passed, {} failed", report.criteria.len() - passed);
    s
}
