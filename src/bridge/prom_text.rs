//! A small, strict reader of the Prometheus text exposition format: enough to pick a few gauges
//! out of an engine's `/metrics`. Comments (`# HELP`, `# TYPE`) and blank lines are skipped;
//! every other line must be `name[{labels}] value [timestamp]` or it is reported as an error
//! (the caller counts it and goes on with the rest).

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {what}")]
pub struct ParseError {
    pub line: usize,
    pub what: &'static str,
}

/// Every sample whose metric name is in `wanted` (other lines are only checked for shape as far
/// as their name), plus the lines that could not be read.
pub fn parse(text: &str, wanted: &[&str]) -> (Vec<Sample>, Vec<ParseError>) {
    let mut samples = Vec::new();
    let mut errors = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(|c: char| c == '{' || c.is_ascii_whitespace())
            .unwrap_or(line.len());
        let name = &line[..name_end];
        if !wanted.contains(&name) {
            continue;
        }
        match parse_rest(&line[name_end..]) {
            Ok((labels, value)) => samples.push(Sample {
                name: name.to_string(),
                labels,
                value,
            }),
            Err(what) => errors.push(ParseError { line: i + 1, what }),
        }
    }
    (samples, errors)
}

type Labels = Vec<(String, String)>;

fn parse_rest(rest: &str) -> Result<(Labels, f64), &'static str> {
    let mut labels = Vec::new();
    let mut rest = rest;
    if let Some(body) = rest.strip_prefix('{') {
        let mut chars = body.char_indices().peekable();
        loop {
            // Skip separators.
            while let Some(&(_, c)) = chars.peek() {
                if c == ',' || c.is_ascii_whitespace() {
                    chars.next();
                } else {
                    break;
                }
            }
            let Some(&(start, c)) = chars.peek() else {
                return Err("unterminated label set");
            };
            if c == '}' {
                rest = &body[start + 1..];
                break;
            }
            let mut end = start;
            while let Some(&(j, c)) = chars.peek() {
                if c.is_ascii_alphanumeric() || c == '_' {
                    end = j + c.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            if end == start {
                return Err("bad label name");
            }
            let key = body[start..end].to_string();
            if chars.next().map(|(_, c)| c) != Some('=')
                || chars.next().map(|(_, c)| c) != Some('"')
            {
                return Err("expected =\" after a label name");
            }
            let mut value = String::new();
            loop {
                match chars.next() {
                    Some((_, '"')) => break,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c @ ('\\' | '"'))) => value.push(c),
                        _ => return Err("bad escape in a label value"),
                    },
                    Some((_, c)) => value.push(c),
                    None => return Err("unterminated label value"),
                }
            }
            labels.push((key, value));
        }
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = fields.next().ok_or("missing value")?;
    let value = match value {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse::<f64>().map_err(|_| "value is not a number")?,
    };
    if let Some(ts) = fields.next() {
        ts.parse::<i64>()
            .map_err(|_| "timestamp is not an integer")?;
    }
    if fields.next().is_some() {
        return Err("trailing text after the timestamp");
    }
    Ok((labels, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_wanted_samples_with_labels_and_skips_the_rest() {
        let text = "# HELP vllm:num_requests_running Number of requests.\n\
                    # TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
                    vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 5\n\
                    vllm:other_total 1.0\n\
                    \n\
                    vllm:kv_cache_usage_perc{model_name=\"a \\\"q\\\" b\",engine=\"0\"} 0.25 1700000000000\n";
        let (samples, errors) = parse(
            text,
            &["vllm:num_requests_running", "vllm:kv_cache_usage_perc"],
        );
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(samples.len(), 3);
        assert_eq!(samples[1].label("engine"), Some("1"));
        assert_eq!(samples[1].value, 5.0);
        assert_eq!(samples[2].label("model_name"), Some("a \"q\" b"));
        assert_eq!(samples[2].value, 0.25);
    }

    #[test]
    fn a_sample_without_labels_reads() {
        let (s, e) = parse("sglang:token_usage 0.5\n", &["sglang:token_usage"]);
        assert!(e.is_empty());
        assert_eq!(s[0].value, 0.5);
        assert!(s[0].labels.is_empty());
    }

    #[test]
    fn broken_lines_are_errors_with_their_line_number() {
        let text = "m{a=\"1\" 2\nm{a=1} 2\nm notanumber\nm{a=\"x\"}\nm 1 2 3\nm 7\n";
        let (samples, errors) = parse(text, &["m"]);
        assert_eq!(samples.len(), 1, "only the last line is a sample");
        assert_eq!(samples[0].value, 7.0);
        let lines: Vec<usize> = errors.iter().map(|e| e.line).collect();
        assert_eq!(lines, vec![1, 2, 3, 4, 5]);
    }
}
