//! Chat templates rendered the way HF `apply_chat_template` renders them, on minijinja.

use crate::jinja_compat;
use crate::TextError;
use minijinja::{AutoEscape, Environment, Value};
use serde_json::{Map, Value as Json};

/// Name HF gives a single, unnamed template.
const DEFAULT_TEMPLATE: &str = "default";
/// Named template HF picks when the request carries tools.
const TOOL_USE_TEMPLATE: &str = "tool_use";

/// One or more compiled chat templates plus the special-token variables they may reference.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    names: Vec<String>,
    special_tokens: Map<String, Json>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `(name, source)` templates; `special_tokens` maps e.g. `bos_token` to its text.
    pub(crate) fn new(
        templates: Vec<(String, String)>,
        special_tokens: Map<String, Json>,
    ) -> Result<Self, TextError> {
        // Same environment settings as transformers' `_compile_jinja_template`.
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", jinja_compat::tojson);
        env.add_function("raise_exception", jinja_compat::raise_exception);
        env.add_function("strftime_now", jinja_compat::strftime_now);
        let mut names = Vec::with_capacity(templates.len());
        for (name, source) in templates {
            env.add_template_owned(name.clone(), source).map_err(|e| {
                TextError::InvalidChatTemplate {
                    name: name.clone(),
                    message: e.to_string(),
                }
            })?;
            names.push(name);
        }
        Ok(Self {
            env,
            names,
            special_tokens,
        })
    }

    /// Renders `messages` (an OpenAI messages array). Keys of `extra` (tools, documents, template
    /// kwargs) become template variables; `messages` and `add_generation_prompt` always win.
    pub(crate) fn render(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
        extra: Option<&Json>,
    ) -> Result<String, TextError> {
        let extra = match extra {
            None | Some(Json::Null) => None,
            Some(Json::Object(map)) => Some(map),
            Some(_) => {
                return Err(TextError::InvalidMessages(
                    "chat template variables must be a JSON object".into(),
                ))
            }
        };
        let has_tools = extra
            .and_then(|m| m.get("tools"))
            .is_some_and(|t| !t.is_null());
        let name = self.select(has_tools)?;

        let mut ctx = self.special_tokens.clone();
        if let Some(extra) = extra {
            ctx.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        ctx.insert("messages".into(), normalize_messages(messages)?);
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );

        let template = self
            .env
            .get_template(name)
            .map_err(|e| TextError::Render(e.to_string()))?;
        template
            .render(Value::from_serialize(&ctx))
            .map_err(|e| TextError::Render(render_error_message(&e)))
    }

    /// HF's choice among named templates: `tool_use` when tools are given and it exists, else
    /// `default`; a lone template is used whatever its name.
    fn select(&self, has_tools: bool) -> Result<&str, TextError> {
        let has = |n: &str| self.names.iter().any(|x| x == n);
        if has_tools && has(TOOL_USE_TEMPLATE) {
            return Ok(TOOL_USE_TEMPLATE);
        }
        if has(DEFAULT_TEMPLATE) {
            return Ok(DEFAULT_TEMPLATE);
        }
        match self.names.as_slice() {
            [only] => Ok(only),
            [] => Err(TextError::NoChatTemplate),
            many => Err(TextError::InvalidChatTemplate {
                name: many.join(", "),
                message: "named chat templates include no \"default\"".into(),
            }),
        }
    }
}

/// `raise_exception` messages are meant for the client verbatim; other errors keep their kind.
fn render_error_message(e: &minijinja::Error) -> String {
    match (e.kind(), e.detail()) {
        (minijinja::ErrorKind::InvalidOperation, Some(detail)) => detail.to_owned(),
        _ => e.to_string(),
    }
}

/// Checks the messages array and flattens list-of-parts `content` into a string, joining text
/// parts with "\n" (as vLLM does for string-content templates). Other message fields pass through.
fn normalize_messages(messages: &Json) -> Result<Json, TextError> {
    let Json::Array(list) = messages else {
        return Err(TextError::InvalidMessages(
            "`messages` must be an array".into(),
        ));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, message) in list.iter().enumerate() {
        let Json::Object(fields) = message else {
            return Err(TextError::InvalidMessages(format!(
                "messages[{i}] must be an object"
            )));
        };
        let mut fields = fields.clone();
        if let Some(Json::Array(parts)) = fields.get("content") {
            let text = join_text_parts(parts, i)?;
            fields.insert("content".into(), Json::String(text));
        }
        out.push(Json::Object(fields));
    }
    Ok(Json::Array(out))
}

fn join_text_parts(parts: &[Json], message_index: usize) -> Result<String, TextError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let text = match part {
            Json::String(s) => Some(s.as_str()),
            Json::Object(p) => match p.get("type").and_then(Json::as_str) {
                Some("text") | None => p.get("text").and_then(Json::as_str),
                Some(other) => {
                    return Err(TextError::InvalidMessages(format!(
                        "messages[{message_index}].content[{j}]: content part type {other:?} is not supported (text only)"
                    )))
                }
            },
            _ => None,
        };
        let text = text.ok_or_else(|| {
            TextError::InvalidMessages(format!(
                "messages[{message_index}].content[{j}] must be a string or {{\"type\": \"text\", \"text\": ...}}"
            ))
        })?;
        texts.push(text);
    }
    Ok(texts.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn template(src: &str) -> ChatTemplate {
        let mut special = Map::new();
        special.insert("bos_token".into(), json!("<s>"));
        ChatTemplate::new(vec![("default".into(), src.into())], special).expect("compiles")
    }

    #[test]
    fn content_parts_are_joined_into_a_string() {
        let t = template("{% for m in messages %}[{{ m.content }}]{% endfor %}");
        let msgs = json!([{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]);
        assert_eq!(t.render(&msgs, false, None).expect("render"), "[a\nb]");
    }

    #[test]
    fn non_text_content_parts_are_rejected_with_their_position() {
        let t = template("{{ messages }}");
        let msgs = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]);
        let err = t.render(&msgs, false, None).expect_err("must fail");
        assert!(err.to_string().contains("messages[0].content[0]"), "{err}");
    }

    #[test]
    fn raise_exception_surfaces_the_template_message() {
        let t = template("{{ raise_exception('roles must alternate') }}");
        let err = t.render(&json!([]), false, None).expect_err("must fail");
        assert_eq!(
            err.to_string(),
            "chat template failed to render: roles must alternate"
        );
    }

    #[test]
    fn python_string_methods_and_trim_blocks_work() {
        let t = template(
            "{% for m in messages %}\n  {% if m.content.startswith(' x') %}{{ m.content.strip() | upper }}{% endif %}\n{% endfor %}",
        );
        let msgs = json!([{"role": "user", "content": " xy "}]);
        assert_eq!(t.render(&msgs, false, None).expect("render"), "XY");
    }

    #[test]
    fn extra_variables_and_special_tokens_are_visible() {
        let t = template("{{ bos_token }}{{ tools | tojson }}{{ add_generation_prompt }}");
        let extra = json!({"tools": [{"name": "f", "b": 1, "a": 2}]});
        assert_eq!(
            t.render(&json!([]), true, Some(&extra)).expect("render"),
            r#"<s>[{"name": "f", "b": 1, "a": 2}]True"#
        );
    }

    #[test]
    fn tool_use_template_is_chosen_when_tools_are_given() {
        let t = ChatTemplate::new(
            vec![
                ("default".into(), "plain".into()),
                ("tool_use".into(), "tools".into()),
            ],
            Map::new(),
        )
        .expect("compiles");
        let tools = json!({"tools": []});
        assert_eq!(t.render(&json!([]), false, None).expect("r"), "plain");
        assert_eq!(
            t.render(&json!([]), false, Some(&tools)).expect("r"),
            "tools"
        );
    }

    #[test]
    fn syntax_errors_are_reported_at_load() {
        let err = ChatTemplate::new(vec![("default".into(), "{% if %}".into())], Map::new())
            .expect_err("must fail");
        assert!(matches!(err, TextError::InvalidChatTemplate { .. }));
    }
}
