//! Structured output fields: the request forms of OpenAI, SGLang and vLLM mapped to one
//! `GrammarSpec` (compiled later, `constraint.rs`), two forms at once refused.

use serde_json::{Map, Value};
use tokenspeed_structured::GrammarSpec;

use crate::constraint::GrammarRequest;
use crate::error::RequestError;
use crate::http::protocol::{ConstraintFields, SamplingFields};

/// What constrains the output: a structured output form, or `allowed_token_ids`; the two
/// together are refused.
pub(super) fn output_constraint(
    f: &SamplingFields,
    vocab_size: u32,
) -> Result<Option<GrammarRequest>, RequestError> {
    let grammar = grammar_request(&f.constraint)?;
    let Some(allowed) = allowed_token_ids(f.allowed_token_ids.as_deref(), vocab_size)? else {
        return Ok(grammar);
    };
    if let Some(other) = &grammar {
        return Err(RequestError::bad_param(
            "allowed_token_ids",
            format!(
                "allowed_token_ids constrains the output, so it cannot be combined with '{}'",
                other.field
            ),
        ));
    }
    Ok(Some(allowed))
}

/// vLLM's `allowed_token_ids`: only these ids may be sampled, as a grammar of any run of them
/// (llguidance's token-id ranges), so the grammar machinery masks the rest.
fn allowed_token_ids(
    ids: Option<&[u32]>,
    vocab_size: u32,
) -> Result<Option<GrammarRequest>, RequestError> {
    let Some(ids) = ids else { return Ok(None) };
    let bad = |m: String| RequestError::bad_param("allowed_token_ids", m);
    if ids.is_empty() {
        return Err(bad("allowed_token_ids must not be empty".into()));
    }
    let out_of_range: Vec<String> = ids
        .iter()
        .filter(|&&t| t >= vocab_size)
        .map(u32::to_string)
        .collect();
    if !out_of_range.is_empty() {
        return Err(bad(format!(
            "token ids {} are out of range (vocabulary size {vocab_size})",
            out_of_range.join(", ")
        )));
    }
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let list: Vec<String> = sorted.iter().map(u32::to_string).collect();
    Ok(Some(GrammarRequest {
        spec: GrammarSpec::Grammar(format!("start: <[{}]>*", list.join(","))),
        field: "allowed_token_ids",
    }))
}

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

/// A JSON schema's objects that declare `properties` and leave `additionalProperties`
/// unspecified get it explicitly: `allow` (`--constrained-json-allow-additional-properties`),
/// by default false as in vLLM and SGLang, where undeclared properties are refused (allowed,
/// a small model keeps inventing them until max_tokens). Every route's schemas pass here
/// (response_format, json_schema, guided_json, structured_outputs, the forced tool call).
pub fn close_objects(mut request: GrammarRequest, allow: bool) -> GrammarRequest {
    if let GrammarSpec::JsonSchema(schema) = &mut request.spec {
        close_schema(schema, allow, false);
    }
    request
}

/// Walks the schema positions of `schema` (not literal values such as `const`). The members
/// of an `allOf` are not closed themselves: each names only part of the properties.
fn close_schema(schema: &mut Value, allow: bool, in_all_of: bool) {
    let Some(obj) = schema.as_object_mut() else {
        return;
    };
    let open_ended = [
        "additionalProperties",
        "unevaluatedProperties",
        "patternProperties",
    ];
    if !in_all_of
        && obj.get("properties").is_some_and(Value::is_object)
        && !open_ended.iter().any(|k| obj.contains_key(*k))
    {
        obj.insert("additionalProperties".into(), Value::Bool(allow));
    }
    for (key, value) in obj.iter_mut() {
        match key.as_str() {
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Some(map) = value.as_object_mut() {
                    map.values_mut().for_each(|v| close_schema(v, allow, false));
                }
            }
            "items" | "prefixItems" | "anyOf" | "oneOf" | "additionalItems" => match value {
                Value::Array(items) => items.iter_mut().for_each(|v| close_schema(v, allow, false)),
                v => close_schema(v, allow, false),
            },
            "allOf" => {
                if let Some(items) = value.as_array_mut() {
                    items.iter_mut().for_each(|v| close_schema(v, allow, true));
                }
            }
            "additionalProperties"
            | "unevaluatedProperties"
            | "unevaluatedItems"
            | "contains"
            | "not"
            | "if"
            | "then"
            | "else"
            | "propertyNames" => close_schema(value, allow, false),
            _ => {}
        }
    }
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
    fn unspecified_additional_properties_are_closed_unless_allowed() {
        let schema = json!({"type": "object",
            "properties": {"city": {"type": "string"},
                           "stops": {"type": "array", "items": {"$ref": "#/$defs/Stop"}}},
            "$defs": {"Stop": {"type": "object", "properties": {"name": {"type": "string"}}},
                      "Open": {"type": "object", "properties": {}, "additionalProperties": true}},
            "anyOf": [{"properties": {"a": {}}}],
            "allOf": [{"properties": {"b": {}}}],
            "const": {"properties": {}}});
        let req = |s: &Value| GrammarRequest {
            spec: GrammarSpec::JsonSchema(s.clone()),
            field: "guided_json",
        };
        let GrammarSpec::JsonSchema(closed) = close_objects(req(&schema), false).spec else {
            panic!("a schema");
        };
        assert_eq!(closed["additionalProperties"], false);
        assert_eq!(closed["$defs"]["Stop"]["additionalProperties"], false);
        assert_eq!(closed["$defs"]["Open"]["additionalProperties"], true);
        assert_eq!(closed["anyOf"][0]["additionalProperties"], false);
        assert!(closed["allOf"][0].get("additionalProperties").is_none());
        assert!(closed["const"].get("additionalProperties").is_none());
        assert!(closed["properties"]["city"]
            .get("additionalProperties")
            .is_none());
        let GrammarSpec::JsonSchema(open) = close_objects(req(&schema), true).spec else {
            panic!("a schema");
        };
        assert_eq!(open["additionalProperties"], true);
        assert_eq!(open["$defs"]["Stop"]["additionalProperties"], true);
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
