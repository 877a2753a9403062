//! Body templates: `{{placeholder}}` parsing, validation at start-up (the body must be JSON
//! whatever the values are) and rendering with JSON-escaped values.

use jiff::Timestamp;

use super::fields::{Ctx, Field, NotifyFields, PlanOutcome, PLACEHOLDERS};
use super::Error;

#[derive(Clone, Debug, PartialEq)]
enum Segment {
    Literal(String),
    Placeholder(Field),
}

/// A parsed body template.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Template {
    segments: Vec<Segment>,
}

/// Which message a template is for (decides the values it is checked with).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessageKind {
    Start,
    Outcome,
}

impl Template {
    #[cfg(test)]
    pub(super) fn parse(text: &str) -> Result<Template, Error> {
        Self::parse_for(text, MessageKind::Start)
    }

    pub(super) fn parse_for(text: &str, kind: MessageKind) -> Result<Template, Error> {
        let mut segments = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find("{{") {
            if start > 0 {
                segments.push(Segment::Literal(rest[..start].to_string()));
            }
            let after = &rest[start + 2..];
            let end = after.find("}}").ok_or_else(|| Error::Template {
                reason: format!(
                    "unclosed placeholder at {:?}",
                    after.chars().take(20).collect::<String>()
                ),
            })?;
            let name = after[..end].trim();
            let field = Field::parse(name).ok_or_else(|| Error::Template {
                reason: format!(
                    "unknown placeholder {{{{{name}}}}} (known: {})",
                    PLACEHOLDERS.join(", ")
                ),
            })?;
            segments.push(Segment::Placeholder(field));
            rest = &after[end + 2..];
        }
        if !rest.is_empty() {
            segments.push(Segment::Literal(rest.to_string()));
        }
        let template = Template { segments };
        // The body must be JSON whatever the values are: render with values that need escaping,
        // and (for outcome messages) with every optional value both present and absent.
        let probe = NotifyFields {
            node: "n\"o\\de\n".into(),
            instance: "i-0{}".into(),
            kind: "interruption".into(),
            source: "aws".into(),
            deadline: None,
            notice_id: "id\t1".into(),
            detail: "\u{1}<>&'".into(),
            action: "checkpoint and drain".into(),
            outcome: None,
            host: false,
        };
        let mut probes = vec![probe.clone()];
        if kind == MessageKind::Outcome {
            probes = vec![
                NotifyFields {
                    outcome: Some(PlanOutcome::default()),
                    ..probe.clone()
                },
                NotifyFields {
                    outcome: Some(PlanOutcome {
                        outcome: "drain_failed".into(),
                        ok: false,
                        checkpoint: "1 acked, 1 \"timeout\"".into(),
                        step: Some(1200),
                        checkpoint_seconds: Some(31.5),
                        budget_seconds: Some(90.0),
                        evicted: 3,
                        blocked_pods: vec!["ns/p\"o".into()],
                        blocking_pdbs: vec!["pdb\\1".into()],
                        drain_error: "api\nserver".into(),
                        plan_seconds: 48.0,
                        save_seconds: Some(12.5),
                        wasted_seconds: Some(3.25),
                        steps_lost: Some(40),
                        badput: "ns/p\"o: badput: thrown away 40 steps\n".into(),
                    }),
                    ..probe
                },
            ];
        }
        for (i, p) in probes.iter().enumerate() {
            let ctx = Ctx {
                dry_run: i % 2 == 0,
                routing_key: "k\"ey",
            };
            let rendered = template.render(p, Timestamp::UNIX_EPOCH, ctx);
            serde_json::from_str::<serde_json::Value>(&rendered).map_err(|e| Error::Template {
                reason: format!(
                    "does not render to valid JSON ({e}); placeholders are substituted as \
                         escaped string contents, so put them inside quotes"
                ),
            })?;
        }
        Ok(template)
    }

    pub(super) fn render(&self, fields: &NotifyFields, now: Timestamp, ctx: Ctx<'_>) -> String {
        let mut out = String::new();
        for segment in &self.segments {
            match segment {
                Segment::Literal(s) => out.push_str(s),
                Segment::Placeholder(field) => {
                    out.push_str(&json_escape(&fields.value(*field, now, ctx)))
                }
            }
        }
        out
    }
}

/// Check a template at start-up: `Err` names the problem.
pub fn check_template(text: &str, kind: MessageKind) -> Result<(), Error> {
    Template::parse_for(text, kind).map(|_| ())
}

/// The contents of a JSON string literal for `s`, without the surrounding quotes.
fn json_escape(s: &str) -> String {
    let quoted = serde_json::Value::String(s.to_string()).to_string();
    quoted
        .strip_prefix('"')
        .and_then(|q| q.strip_suffix('"'))
        .unwrap_or_default()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::super::fields::tests::{fields, now};
    use super::*;

    #[test]
    fn every_placeholder_renders() {
        let text = PLACEHOLDERS
            .iter()
            .map(|p| format!("\"{p}\": \"{{{{{p}}}}}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let t = Template::parse(&format!("{{{text}}}")).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&t.render(&fields(), now(), Ctx::default())).unwrap();
        let want = serde_json::json!({
            "node": "gpu-node-1",
            "instance": "i-0abc",
            "kind": "interruption",
            "source": "aws",
            "deadline": "2023-11-14T22:15:20Z",
            "deadline_unix": "1700000120",
            "time_left": "2m",
            "notice_id": "9f8e7d6c",
            "detail": "terminate",
            "action": "checkpoint and drain",
            "message": "start",
            "summary": "interruption notice on node gpu-node-1 (aws), deadline 2023-11-14T22:15:20Z (2m left): checkpoint and drain",
            "severity": "warning",
            "event_action": "trigger",
            "dry_run": "false",
            "dry_run_tag": "",
            "routing_key": "",
            "outcome": "",
            "ok": "",
            "checkpoint": "",
            "step": "",
            "checkpoint_seconds": "",
            "budget_seconds": "",
            "headroom_seconds": "",
            "evicted": "",
            "blocked": "",
            "blocked_pods": "",
            "blocking_pdbs": "",
            "drain_error": "",
            "plan_seconds": "",
            "save_seconds": "",
            "wasted_seconds": "",
            "steps_lost": "",
            "badput": "",
        });
        assert_eq!(v, want);
        // The outcome message fills the outcome placeholders.
        let mut f = fields();
        f.outcome = Some(PlanOutcome {
            outcome: "completed".into(),
            ok: true,
            checkpoint: "1 acked".into(),
            step: Some(7),
            checkpoint_seconds: Some(30.0),
            budget_seconds: Some(90.0),
            evicted: 2,
            plan_seconds: 41.25,
            save_seconds: Some(30.0),
            wasted_seconds: Some(0.0),
            steps_lost: Some(0),
            badput: "ns/p: badput: checkpoint save 30.0s, nothing thrown away".into(),
            ..PlanOutcome::default()
        });
        let v: serde_json::Value = serde_json::from_str(&t.render(
            &f,
            now(),
            Ctx {
                dry_run: true,
                routing_key: "k",
            },
        ))
        .unwrap();
        for (k, want) in [
            ("message", "outcome"),
            ("severity", "info"),
            ("event_action", "resolve"),
            ("dry_run", "true"),
            ("dry_run_tag", "[DRY RUN] "),
            ("routing_key", "k"),
            ("ok", "true"),
            ("step", "7"),
            ("headroom_seconds", "60.0"),
            ("evicted", "2"),
            ("blocked", "0"),
            ("plan_seconds", "41.2"),
            ("save_seconds", "30.0"),
            ("steps_lost", "0"),
            (
                "badput",
                "ns/p: badput: checkpoint save 30.0s, nothing thrown away",
            ),
        ] {
            assert_eq!(v[k], want, "{k}");
        }
    }

    #[test]
    fn no_deadline_means_now() {
        let t =
            Template::parse(r#"{"a": "{{deadline}}|{{deadline_unix}}|{{time_left}}"}"#).unwrap();
        let mut f = fields();
        f.deadline = None;
        assert_eq!(t.render(&f, now(), Ctx::default()), r#"{"a": "now||0s"}"#);
        // A deadline in the past: zero time left.
        f.deadline = Some(Timestamp::from_second(1_600_000_000).unwrap());
        assert!(t.render(&f, now(), Ctx::default()).ends_with("|0s\"}"));
    }

    #[test]
    fn placeholders_tolerate_inner_spaces_and_repeat() {
        let t = Template::parse(r#"{"t": "{{ node }}/{{node}}"}"#).unwrap();
        assert_eq!(
            t.render(&fields(), now(), Ctx::default()),
            r#"{"t": "gpu-node-1/gpu-node-1"}"#
        );
    }

    #[test]
    fn values_are_json_escaped() {
        let t = Template::parse(r#"{"t": "{{node}}"}"#).unwrap();
        for hostile in [
            "a\"b",
            "back\\slash",
            "line\nbreak\r\t",
            "\u{0}\u{1f}",
            "\"}, \"injected\": {\"x\": \"",
            "ünïcødé ✓ 🚀",
            "{{kind}}",
        ] {
            let mut f = fields();
            f.node = hostile.into();
            let rendered = t.render(&f, now(), Ctx::default());
            let v: serde_json::Value = serde_json::from_str(&rendered)
                .unwrap_or_else(|e| panic!("{hostile:?} broke the JSON: {e}: {rendered}"));
            assert_eq!(v, serde_json::json!({ "t": hostile }), "{hostile:?}");
        }
    }

    #[test]
    fn bad_templates_are_rejected_with_the_reason() {
        let cases = [
            (r#"{"t": "{{nodes}}"}"#, "unknown placeholder {{nodes}}"),
            (r#"{"t": "{{}}"}"#, "unknown placeholder {{}}"),
            (r#"{"t": "{{node"}"#, "unclosed placeholder"),
            (r#"{"t": "{{ node }"}"#, "unclosed placeholder"),
            (r#"{"t": {{node}}}"#, "valid JSON"),
            (r#"text only {{node}}"#, "valid JSON"),
            ("", "valid JSON"),
            (r#"{"t": "x""#, "valid JSON"),
        ];
        for (template, needle) in cases {
            let err = Template::parse(template).expect_err(template);
            assert!(
                err.to_string().contains(needle),
                "{template:?}: {err} lacks {needle:?}"
            );
            assert_eq!(err.metric_label(), "template");
            assert!(!err.is_retryable());
        }
    }
}
