//! Structured output fields: the request forms of OpenAI, SGLang and vLLM mapped to one
//! `GrammarSpec` (compiled later, `constraint.rs`), two forms at once refused.

use serde_json::{Map, Value};
use tokenspeed_structured::GrammarSpec;

use crate::constraint::GrammarRequest;
use crate::error::RequestError;
use crate::http::protocol::ConstraintFields;

/// The grammar a request's fields ask for, if any; two forms at once are refused.
pub fn grammar_request(f: &ConstraintFields) -> Result<Option<GrammarRequest>, RequestError> {
    let mut found: Vec<GrammarRequest> = Vec::new();
    let mut add = |field: &'static str, spec: Option<GrammarSpec>| {
        if let Some(spec) = spec {
            found.push(GrammarRequest { spec, field });
        }
    };
    add(
        "response_format",
        f.response_format
            .as_ref()
            .map(response_format)
            .transpose()?
            .flatten(),
    );
    add(
        "json_schema",
        f.json_schema
            .as_ref()
            .map(|v| schema("json_schema", v))
            .transpose()?,
    );
    add("regex", f.regex.clone().map(GrammarSpec::Regex));
    add("ebnf", f.ebnf.clone().map(GrammarSpec::Grammar));
    add(
        "structural_tag",
        f.structural_tag
            .as_ref()
            .map(|v| json_value("structural_tag", v).map(GrammarSpec::StructuralTag))
            .transpose()?,
    );
    add(
        "guided_json",
        f.guided_json
            .as_ref()
            .map(|v| schema("guided_json", v))
            .transpose()?,
    );
    add(
        "guided_regex",
        f.guided_regex.clone().map(GrammarSpec::Regex),
    );
    add(
        "guided_choice",
        f.guided_choice.clone().map(GrammarSpec::Choice),
    );
    add(
        "guided_grammar",
        f.guided_grammar.clone().map(GrammarSpec::Grammar),
    );
    add(
        "structured_outputs",
        f.structured_outputs
            .as_ref()
            .map(structured_outputs)
            .transpose()?,
    );
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|g| g.field).collect();
        return Err(RequestError::bad_param(
            found[1].field,
            format!(
                "only one structured output form may be given, got {}",
                names.join(" and ")
            ),
        ));
    }
    Ok(found.pop())
}

/// OpenAI's `response_format`; `{"type": "text"}` constrains nothing.
fn response_format(v: &Value) -> Result<Option<GrammarSpec>, RequestError> {
    const FIELD: &str = "response_format";
    let bad = |m: String| RequestError::bad_param(FIELD, m);
    let obj = v
        .as_object()
        .ok_or_else(|| bad("response_format must be an object with a \"type\"".into()))?;
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GrammarSpec::JsonObject)),
        Some("json_schema") => {
            let js = obj
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    bad("response_format of type json_schema needs a \"json_schema\" object".into())
                })?;
            // OpenAI nests the schema under "schema"; absent, any JSON value matches.
            let schema = js
                .get("schema")
                .cloned()
                .unwrap_or(Value::Object(Map::new()));
            Ok(Some(GrammarSpec::JsonSchema(schema)))
        }
        Some("structural_tag") => {
            let mut tag = obj.clone();
            tag.remove("type");
            Ok(Some(GrammarSpec::StructuralTag(Value::Object(tag))))
        }
        Some(other) => Err(bad(format!(
            "response_format type {other:?} is not one of \"text\", \"json_object\", \
             \"json_schema\", \"structural_tag\""
        ))),
        None => Err(bad("response_format needs a string \"type\"".into())),
    }
}

/// vLLM's `structured_outputs` object: exactly one of its forms.
fn structured_outputs(o: &Map<String, Value>) -> Result<GrammarSpec, RequestError> {
    const FIELD: &str = "structured_outputs";
    let bad = |m: String| RequestError::bad_param(FIELD, m);
    let set: Vec<(&String, &Value)> = o
        .iter()
        .filter(|(k, v)| {
            !v.is_null() && *k != "disable_any_whitespace" && *k != "whitespace_pattern"
        })
        .filter(|(k, v)| !(*k == "json_object" && **v == Value::Bool(false)))
        .collect();
    let [(key, value)] = set.as_slice() else {
        return Err(bad(format!(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object, \
             structural_tag; got {}",
            set.len()
        )));
    };
    let text = |v: &Value| {
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| bad(format!("structured_outputs.{key} must be a string")))
    };
    Ok(match key.as_str() {
        "json" => schema(FIELD, value)?,
        "regex" => GrammarSpec::Regex(text(value)?),
        "grammar" => GrammarSpec::Grammar(text(value)?),
        "choice" => GrammarSpec::Choice(
            serde_json::from_value((*value).clone())
                .map_err(|_| bad("structured_outputs.choice must be a list of strings".into()))?,
        ),
        "json_object" => GrammarSpec::JsonObject,
        "structural_tag" => GrammarSpec::StructuralTag(json_value(FIELD, value)?),
        other => {
            return Err(bad(format!(
                "structured_outputs.{other} is not a structured output form"
            )))
        }
    })
}

/// A JSON schema given as an object or as JSON text (SGLang sends text).
fn schema(field: &'static str, v: &Value) -> Result<GrammarSpec, RequestError> {
    json_value(field, v).map(GrammarSpec::JsonSchema)
}

fn json_value(field: &'static str, v: &Value) -> Result<Value, RequestError> {
    match v {
        Value::String(text) => serde_json::from_str(text)
            .map_err(|e| RequestError::bad_param(field, format!("{field} is not valid JSON: {e}"))),
        other => Ok(other.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: Value) -> ConstraintFields {
        serde_json::from_value(v).expect("fields")
    }

    #[test]
    fn every_request_form_maps_to_its_spec() {
        let schema = json!({"type": "object"});
        let cases = [
            (
                json!({"response_format": {"type": "json_object"}}),
                GrammarSpec::JsonObject,
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
                GrammarSpec::JsonSchema(schema.clone()),
            ),
            (
                json!({"json_schema": schema.to_string()}),
                GrammarSpec::JsonSchema(schema.clone()),
            ),
            (
                json!({"guided_json": schema}),
                GrammarSpec::JsonSchema(schema.clone()),
            ),
            (json!({"regex": "a+"}), GrammarSpec::Regex("a+".into())),
            (
                json!({"guided_regex": "a+"}),
                GrammarSpec::Regex("a+".into()),
            ),
            (
                json!({"ebnf": "root ::= \"a\""}),
                GrammarSpec::Grammar("root ::= \"a\"".into()),
            ),
            (
                json!({"guided_grammar": "g"}),
                GrammarSpec::Grammar("g".into()),
            ),
            (
                json!({"guided_choice": ["a", "b"]}),
                GrammarSpec::Choice(vec!["a".into(), "b".into()]),
            ),
            (
                json!({"structured_outputs": {"choice": ["a"]}}),
                GrammarSpec::Choice(vec!["a".into()]),
            ),
            (
                json!({"structured_outputs": {"json": schema}}),
                GrammarSpec::JsonSchema(schema.clone()),
            ),
            (
                json!({"structured_outputs": {"json_object": true}}),
                GrammarSpec::JsonObject,
            ),
        ];
        for (body, want) in cases {
            let got = grammar_request(&fields(body.clone()))
                .expect("valid")
                .expect("a grammar");
            assert_eq!(got.spec, want, "{body}");
        }
        let none = grammar_request(&fields(json!({"response_format": {"type": "text"}})));
        assert_eq!(none.expect("valid"), None);
    }

    #[test]
    fn bad_forms_are_400s_naming_the_field() {
        for (body, field) in [
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format",
            ),
            (json!({"response_format": "json"}), "response_format"),
            (json!({"json_schema": "{not json"}), "json_schema"),
            (json!({"regex": "a", "guided_json": {}}), "guided_json"),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                "structured_outputs",
            ),
        ] {
            let err = grammar_request(&fields(body.clone())).expect_err("invalid");
            assert_eq!(err.param(), Some(field), "{body}");
        }
    }
}
