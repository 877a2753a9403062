//! Ready-made bodies for common receivers (`--webhook-preset`): Slack (the default), Teams,
//! PagerDuty.

/// The default start body (the Slack preset): Slack-compatible, and readable in
/// Teams/Mattermost/Discord-style receivers that accept `{"text": ...}` as well.
pub const DEFAULT_TEMPLATE: &str = r#"{"text": "{{dry_run_tag}}spotguard: {{kind}} notice on node {{node}} (instance {{instance}}, {{source}}), deadline {{deadline}} ({{time_left}} left): {{action}}. Notice {{notice_id}}: {{detail}}"}"#;

/// Ready-made bodies for common receivers (`--webhook-preset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// `{"text": …}`: Slack incoming webhooks, Mattermost, Rocket.Chat.
    Slack,
    /// A Microsoft Teams MessageCard (incoming webhook / Workflows).
    Teams,
    /// PagerDuty Events API v2 (needs `--webhook-routing-key`): the start triggers an incident
    /// keyed by node and notice, a clean outcome resolves it, a problem re-triggers it as `error`.
    Pagerduty,
}

impl Preset {
    /// (start, outcome) templates.
    pub fn templates(self) -> (&'static str, &'static str) {
        match self {
            Preset::Slack => (
                DEFAULT_TEMPLATE,
                r#"{"text": "{{dry_run_tag}}spotguard: {{summary}}"}"#,
            ),
            Preset::Teams => (
                r#"{"@type": "MessageCard", "@context": "https://schema.org/extensions", "themeColor": "E8A317", "summary": "{{dry_run_tag}}spotguard: {{kind}} on {{node}}", "title": "{{dry_run_tag}}spotguard: {{kind}} notice on {{node}}", "text": "{{summary}}"}"#,
                r#"{"@type": "MessageCard", "@context": "https://schema.org/extensions", "themeColor": "0078D7", "summary": "{{dry_run_tag}}spotguard: {{kind}} on {{node}} {{outcome}}", "title": "{{dry_run_tag}}spotguard: {{kind}} on {{node}}: {{outcome}}", "text": "{{summary}}"}"#,
            ),
            Preset::Pagerduty => (PAGERDUTY, PAGERDUTY),
        }
    }
}

const PAGERDUTY: &str = r#"{"routing_key": "{{routing_key}}", "event_action": "{{event_action}}", "dedup_key": "spotguard/{{node}}/{{notice_id}}", "payload": {"summary": "{{dry_run_tag}}{{summary}}", "source": "{{node}}", "severity": "{{severity}}", "component": "spotguard", "group": "{{source}}", "class": "{{kind}}", "custom_details": {"instance": "{{instance}}", "deadline": "{{deadline}}", "outcome": "{{outcome}}", "checkpoint": "{{checkpoint}}", "step": "{{step}}", "checkpoint_seconds": "{{checkpoint_seconds}}", "budget_seconds": "{{budget_seconds}}", "evicted": "{{evicted}}", "blocked_pods": "{{blocked_pods}}", "blocking_pdbs": "{{blocking_pdbs}}", "drain_error": "{{drain_error}}", "dry_run": "{{dry_run}}"}}}"#;

#[cfg(test)]
mod tests {
    use super::super::fields::tests::{fields, now};
    use super::super::fields::Ctx;
    use super::super::template::Template;
    use super::*;

    #[test]
    fn default_template_is_slack_shaped() {
        let t = Template::parse(DEFAULT_TEMPLATE).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&t.render(&fields(), now(), Ctx::default())).unwrap();
        let obj = v.as_object().unwrap();
        assert_eq!(obj.len(), 1);
        let text = obj["text"].as_str().unwrap();
        for part in [
            "interruption",
            "gpu-node-1",
            "i-0abc",
            "aws",
            "2m",
            "9f8e7d6c",
        ] {
            assert!(text.contains(part), "{text} lacks {part}");
        }
    }
}
