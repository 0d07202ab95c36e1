//! Several models' metrics in one Prometheus text exposition: each model's dispatcher keeps its
//! own registry, so `/metrics` gives every sample of each a `model` label and groups each
//! metric family's samples under one header, as the text format requires.

/// One metric family: its header lines (`# HELP`, `# TYPE`, `# UNIT`) and its samples.
struct Family {
    name: String,
    header: Vec<String>,
    samples: Vec<String>,
}

/// Merges `(model, exposition)` pairs (each ending in `# EOF`) into one exposition whose
/// samples carry `model="<id>"` first among their labels; families keep the order they are
/// first seen in. `tail` (already labelled families) goes before the end marker.
pub fn merge_by_model(parts: &[(String, String)], tail: &str) -> String {
    let mut families: Vec<Family> = Vec::new();
    for (model, text) in parts {
        let label = format!("model=\"{}\"", model.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n"));
        let mut current: Option<usize> = None;
        for line in text.lines() {
            if line == "# EOF" || line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# ") {
                // `# HELP name …`, `# TYPE name …`, `# UNIT name …`: the family's header.
                let name = rest.split_whitespace().nth(1).unwrap_or("").to_string();
                let at = match families.iter().position(|f| f.name == name) {
                    Some(at) => at,
                    None => {
                        families.push(Family { name, header: Vec::new(), samples: Vec::new() });
                        families.len() - 1
                    }
                };
                if !families[at].header.iter().any(|h| h == line) && families[at].samples.is_empty() {
                    families[at].header.push(line.to_string());
                }
                current = Some(at);
                continue;
            }
            let labelled = with_label(line, &label);
            match current {
                Some(at) => families[at].samples.push(labelled),
                // A sample before any header (not written by prometheus-client): its own family.
                None => families.push(Family { name: String::new(), header: Vec::new(), samples: vec![labelled] }),
            }
        }
    }
    let mut out = String::new();
    for f in &families {
        for line in f.header.iter().chain(&f.samples) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.push_str(tail);
    out.push_str("# EOF\n");
    out
}

/// `name{a="b"} 1` → `name{model="m",a="b"} 1`; `name 1` → `name{model="m"} 1`.
fn with_label(sample: &str, label: &str) -> String {
    let name_end = sample.find(['{', ' ']).unwrap_or(sample.len());
    let (name, rest) = sample.split_at(name_end);
    match rest.strip_prefix('{') {
        Some(labels) if labels.starts_with('}') => format!("{name}{{{label}{labels}"),
        Some(labels) => format!("{name}{{{label},{labels}"),
        None => format!("{name}{{{label}}}{rest}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_family_once_with_every_models_samples_labelled() {
        let a = "# HELP headroom_requests Requests.\n# TYPE headroom_requests counter\nheadroom_requests_total{device=\"gpu\",outcome=\"completed\"} 3\n# HELP headroom_degraded Degraded.\n# TYPE headroom_degraded gauge\nheadroom_degraded 0\n# EOF\n";
        let b = "# HELP headroom_requests Requests.\n# TYPE headroom_requests counter\nheadroom_requests_total{device=\"cpu\",outcome=\"completed\"} 1\n# HELP headroom_degraded Degraded.\n# TYPE headroom_degraded gauge\nheadroom_degraded 1\n# EOF\n";
        let merged = merge_by_model(&[("a".into(), a.into()), ("b\"x".into(), b.into())], "# HELP extra X.\n# TYPE extra gauge\nextra{model=\"a\"} 1\n");
        assert_eq!(
            merged,
            "# HELP headroom_requests Requests.\n# TYPE headroom_requests counter\n\
             headroom_requests_total{model=\"a\",device=\"gpu\",outcome=\"completed\"} 3\n\
             headroom_requests_total{model=\"b\\\"x\",device=\"cpu\",outcome=\"completed\"} 1\n\
             # HELP headroom_degraded Degraded.\n# TYPE headroom_degraded gauge\n\
             headroom_degraded{model=\"a\"} 0\nheadroom_degraded{model=\"b\\\"x\"} 1\n\
             # HELP extra X.\n# TYPE extra gauge\nextra{model=\"a\"} 1\n# EOF\n"
        );
    }

    #[test]
    fn empty_label_sets_take_the_model_alone() {
        assert_eq!(with_label("x{} 1", "model=\"m\""), "x{model=\"m\"} 1");
        assert_eq!(with_label("x_bucket{le=\"0.5\"} 2", "model=\"m\""), "x_bucket{model=\"m\",le=\"0.5\"} 2");
    }
}
