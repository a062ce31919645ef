//! `tool_choice` "required" and a named function, enforced with a grammar in vLLM's way: the
//! output is not the model's own tool-call format but JSON the grammar dictates, so it always
//! parses and its arguments always follow the function's schema.
//!
//! - required: a JSON array of `{"name": .., "parameters": {..}}`, at least one (one only when
//!   `parallel_tool_calls` is false), each name one of the tools and its parameters that tool's
//!   schema. Parse and stream it with `ToolCallFormat::JsonArray`.
//! - named: the whole output is the arguments object of that function; the call is the name plus
//!   the output text (stream: the name first, then every text delta as an argument fragment).

use super::{mistral, CallSnapshot, Snapshot};
use crate::json_scan::skip_ws;
use serde_json::{json, Value as Json};

/// A tool as in the OpenAI request: `{"type": "function", "function": {"name", "parameters"}}`.
fn function_of(tool: &Json) -> Result<(&str, Json), String> {
    let f = tool.get("function").unwrap_or(tool);
    let name = f
        .get("name")
        .and_then(Json::as_str)
        .ok_or("a tool has no function name")?;
    let params = f
        .get("parameters")
        .cloned()
        .unwrap_or_else(|| json!({"type": "object"}));
    Ok((name, params))
}

/// The JSON schema of the output for `tool_choice: "required"`.
pub fn required_schema(tools: &[Json], parallel_tool_calls: bool) -> Result<Json, String> {
    if tools.is_empty() {
        return Err("tool_choice \"required\" needs at least one tool".into());
    }
    let calls = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (name, mut params) = function_of(t)?;
            // The parameters sit at this place in the combined schema: their own references
            // (`#/$defs/..`, pydantic's nested models) must point there, not at its root.
            rebase_refs(
                &mut params,
                &format!("#/items/anyOf/{i}/properties/parameters"),
            );
            Ok(json!({"type": "object",
                      "properties": {"name": {"const": name}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": false}))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
    if !parallel_tool_calls {
        schema["maxItems"] = json!(1);
    }
    Ok(schema)
}

/// Rewrites the document-local references (`#`, `#/...`) of a schema moved to `base` in a
/// larger document. Literal values (`const`, `enum`, `default`, `examples`) are left alone.
fn rebase_refs(schema: &mut Json, base: &str) {
    match schema {
        Json::Object(map) => {
            for (key, value) in map.iter_mut() {
                match (key.as_str(), value) {
                    ("$ref", Json::String(r)) if r == "#" || r.starts_with("#/") => {
                        *r = format!("{base}{}", &r[1..]);
                    }
                    ("const" | "enum" | "default" | "examples", _) => {}
                    (_, v) => rebase_refs(v, base),
                }
            }
        }
        Json::Array(items) => items.iter_mut().for_each(|v| rebase_refs(v, base)),
        _ => {}
    }
}

/// The JSON schema of the output for a named `tool_choice`: that function's parameters.
pub fn named_schema(tools: &[Json], name: &str) -> Result<Json, String> {
    for tool in tools {
        let (tool_name, params) = function_of(tool)?;
        if tool_name == name {
            return Ok(params);
        }
    }
    Err(format!(
        "tool_choice names function {name:?}, which is not among the tools"
    ))
}

/// `[{"name": .., "parameters": ..}, ..]` from the start of the text.
pub(crate) fn snapshot(text: &str, finished: bool) -> Snapshot {
    let mut snap = Snapshot::default();
    let i = skip_ws(text.as_bytes(), 0);
    match text.as_bytes().get(i) {
        Some(b'[') => mistral::array_calls(text, i + 1, &mut snap),
        Some(_) => snap.content = text.to_string(),
        None if finished => snap.content = text.to_string(),
        None => {}
    }
    if finished {
        snap.calls.retain(|c: &CallSnapshot| c.name.is_some());
    }
    snap
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn required_keeps_each_tools_own_references_reachable() {
        // What pydantic emits for a nested model: `$defs` beside the properties, `$ref`s to it.
        let params = json!({"$defs": {"City": {"type": "object",
                                               "properties": {"name": {"type": "string"}}}},
                            "type": "object",
                            "properties": {"city": {"$ref": "#/$defs/City"},
                                           "again": {"$ref": "#"},
                                           "note": {"const": {"$ref": "#/x"}}}});
        let tool = |name: &str| {
            json!({"type": "function",
                                       "function": {"name": name, "parameters": params}})
        };
        let schema = required_schema(&[tool("a"), tool("b")], true).expect("schema");
        let b = &schema["items"]["anyOf"][1]["properties"]["parameters"];
        assert_eq!(
            b["properties"]["city"]["$ref"],
            "#/items/anyOf/1/properties/parameters/$defs/City"
        );
        assert_eq!(
            b["properties"]["again"]["$ref"],
            "#/items/anyOf/1/properties/parameters"
        );
        assert_eq!(b["properties"]["note"]["const"]["$ref"], "#/x");
        // Each rebased pointer resolves in the combined document.
        let target = schema
            .pointer("/items/anyOf/1/properties/parameters/$defs/City")
            .expect("resolves");
        assert_eq!(target["type"], "object");
    }
}
