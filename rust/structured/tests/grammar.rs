//! Grammar-constrained decoding on the real test-asset tokenizers: seeded random walks over the
//! allowed tokens end in outputs that parse and validate; invalid specs are errors.

#[path = "../../text/tests/common/mod.rs"]
mod common;

use common::{LLAMA3, QWEN2, SMOLLM2, SPM_LEGACY, SPM_METASPACE};
use serde_json::{json, Value};
use std::sync::Arc;
use tokenspeed_structured::{GrammarCompiler, GrammarError, GrammarSpec, MatchError, Matcher};
use tokenspeed_text::TextTokenizer;

/// SplitMix64: a seeded generator, so a failing walk replays exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// A tokenizer with its compiler and, per id, the kind of its first char (a letter, a digit,
/// whitespace, or the punctuation char itself). The walk picks a kind uniformly, then a token
/// of it: a `"` or `@` is then as likely as any word, so walks through strings and patterns end
/// in tens of steps instead of wandering among 100k word pieces.
struct Harness {
    tok: &'static TextTokenizer,
    compiler: GrammarCompiler,
    kind: Vec<char>,
}

impl Harness {
    fn new(tok: &'static TextTokenizer) -> Self {
        let compiler = GrammarCompiler::new(tok, tok.vocab_size()).expect("compiler");
        let kind = (0..tok.vocab_size() as u32)
            .map(|id| {
                let text = tok.decode(&[id], false).unwrap_or_default();
                match text.chars().next() {
                    None => 's',
                    Some(c) if c.is_ascii_punctuation() => c,
                    Some(c) if c.is_alphabetic() => 'a',
                    Some(c) if c.is_numeric() => '0',
                    Some(c) if c.is_whitespace() => ' ',
                    Some(_) => 'u',
                }
            })
            .collect();
        Self {
            tok,
            compiler,
            kind,
        }
    }

    fn allowed(&self, mask: &[u32]) -> Vec<u32> {
        (0..self.compiler.vocab_size() as u32)
            .filter(|&id| mask[id as usize / 32] >> (id % 32) & 1 == 1)
            .collect()
    }

    /// Drives `matcher` with a seeded walk over allowed tokens until the grammar finishes or
    /// eos is sampled; returns the text (eos excluded).
    fn walk(&self, matcher: &mut Matcher, seed: u64) -> String {
        let mut rng = Rng(seed);
        let eos = self.compiler.eos_token_ids();
        let mut mask = vec![0u32; self.compiler.bitmask_words()];
        let mut ids = Vec::new();
        for _ in 0..3000 {
            if matcher.is_finished() {
                break;
            }
            matcher.fill_next_token_bitmask(&mut mask).expect("mask");
            let allowed = self.allowed(&mask);
            assert!(!allowed.is_empty(), "empty mask after {ids:?}");
            let ends: Vec<u32> = allowed
                .iter()
                .copied()
                .filter(|t| eos.contains(t))
                .collect();
            let mut kinds: Vec<char> = allowed.iter().map(|&t| self.kind[t as usize]).collect();
            kinds.sort_unstable();
            kinds.dedup();
            // Past a few dozen tokens, lean on what closes (quotes, brackets), so strings,
            // numbers and whitespace runs stay of sane length.
            let closing: Vec<char> = kinds
                .iter()
                .copied()
                .filter(|k| matches!(k, '"' | '}' | ']'))
                .collect();
            if ids.len() > 40 && !closing.is_empty() && rng.chance(0.7) {
                kinds = closing;
            }
            let token = if !ends.is_empty() && rng.chance(0.3) {
                ends[0]
            } else {
                let kind = kinds[rng.below(kinds.len())];
                let of_kind: Vec<u32> = allowed
                    .iter()
                    .copied()
                    .filter(|&t| self.kind[t as usize] == kind)
                    .collect();
                of_kind[rng.below(of_kind.len())]
            };
            matcher
                .consume_token(token)
                .expect("allowed token consumed");
            if eos.contains(&token) {
                break;
            }
            ids.push(token);
        }
        assert!(matcher.is_finished(), "walk did not finish: {ids:?}");
        self.tok.decode(&ids, false).expect("decode")
    }

    fn compile(&self, spec: GrammarSpec) -> Matcher {
        self.compiler
            .compile(&spec)
            .unwrap_or_else(|e| panic!("{spec:?}: {e}"))
            .matcher()
    }
}

fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        (
            "nested objects, required and optional",
            json!({"type": "object", "properties": {
                "name": {"type": "string"},
                "address": {"type": "object", "properties": {
                    "city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
                "age": {"type": "integer"}},
             "required": ["name", "address"], "additionalProperties": false}),
        ),
        (
            "array with bounds",
            json!({"type": "object", "properties": {
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                         "minItems": 2, "maxItems": 4}},
             "required": ["tags"], "additionalProperties": false}),
        ),
        (
            "enum",
            json!({"type": "object", "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": false}),
        ),
        (
            "pattern",
            json!({"type": "object", "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
             "required": ["code", "email"], "additionalProperties": false}),
        ),
        (
            "anyOf",
            json!({"type": "object", "properties": {
                "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5},
                                    {"type": "null"}]}},
             "required": ["value"], "additionalProperties": false}),
        ),
        (
            "number ranges",
            json!({"type": "object", "properties": {
                "percent": {"type": "integer", "minimum": 0, "maximum": 100},
                "temperature": {"type": "number", "minimum": -40.5, "maximum": 50},
                "positive": {"type": "number", "exclusiveMinimum": 0}},
             "required": ["percent", "temperature", "positive"], "additionalProperties": false}),
        ),
        (
            "$defs and $ref",
            json!({"type": "object", "$defs": {
                "point": {"type": "object", "properties": {"x": {"type": "number"},
                          "y": {"type": "number"}}, "required": ["x", "y"],
                          "additionalProperties": false}},
             "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
             "required": ["from", "to"], "additionalProperties": false}),
        ),
        (
            "string lengths, const, booleans",
            json!({"type": "object", "properties": {
                "id": {"type": "string", "minLength": 3, "maxLength": 6},
                "version": {"const": 2},
                "active": {"type": "boolean"},
                "note": {"type": "null"}},
             "required": ["id", "version", "active"], "additionalProperties": false}),
        ),
        (
            "array of objects",
            json!({"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "properties": {
                    "name": {"type": "string", "enum": ["get_weather", "get_time"]},
                    "arguments": {"type": "object", "properties": {
                        "city": {"type": "string"}}, "required": ["city"],
                        "additionalProperties": false}},
                "required": ["name", "arguments"], "additionalProperties": false}}),
        ),
        (
            "pydantic style with titles and descriptions",
            json!({"title": "Person", "type": "object", "description": "A person",
             "properties": {
                "first_name": {"title": "First Name", "type": "string"},
                "scores": {"title": "Scores", "type": "array",
                           "items": {"type": "integer", "minimum": 1, "maximum": 10},
                           "maxItems": 5}},
             "required": ["first_name", "scores"]}),
        ),
    ]
}

/// Parses JSON as a validator would. JSON numbers have no range, and the grammar allows
/// `470648e+481`, which serde_json refuses as out of f64's range: such exponents are clamped to
/// 300 (sign and magnitude class kept, so `maximum`/`minimum` checks still bite).
fn parse_json(text: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str(text).or_else(|e| {
        if !e.to_string().contains("number out of range") {
            return Err(e);
        }
        let big = regex::Regex::new(r"([0-9])[eE]([+-]?)0*([0-9]{3,})").unwrap();
        let clamped = big.replace_all(text, |c: &regex::Captures| {
            let exp: u64 = c[3].parse().unwrap_or(u64::MAX);
            let exp = if exp > 300 {
                "300".to_string()
            } else {
                c[3].to_string()
            };
            format!("{}e{}{}", &c[1], &c[2], exp)
        });
        serde_json::from_str(&clamped)
    })
}

fn check_schemas(harness: &Harness, name: &str) {
    for (what, schema) in schemas() {
        let validator = jsonschema::validator_for(&schema).expect("test schema is valid");
        for seed in 0..4u64 {
            let mut m = harness.compile(GrammarSpec::JsonSchema(schema.clone()));
            let text = harness.walk(&mut m, seed);
            let value = parse_json(&text)
                .unwrap_or_else(|e| panic!("{name}/{what}/seed {seed}: not JSON ({e}): {text:?}"));
            if let Err(e) = validator.validate(&value) {
                panic!("{name}/{what}/seed {seed}: {text} does not validate: {e}");
            }
        }
    }
}

#[test]
fn json_schema_walks_validate_on_llama3() {
    check_schemas(&Harness::new(&LLAMA3), "llama3");
}

#[test]
fn json_schema_walks_validate_on_smollm2() {
    check_schemas(&Harness::new(&SMOLLM2), "smollm2");
}

#[test]
fn json_object_walks_are_objects() {
    let h = Harness::new(&QWEN2);
    for seed in 0..4 {
        let text = h.walk(&mut h.compile(GrammarSpec::JsonObject), seed);
        let value = parse_json(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(value.is_object(), "{text}");
    }
}

#[test]
fn regex_and_choice_outputs_match() {
    let h = Harness::new(&LLAMA3);
    let re = regex::Regex::new(r"^\d{3}-[a-z]{2,4}(\.\d+)?$").unwrap();
    for seed in 0..6 {
        let spec = GrammarSpec::Regex(r"\d{3}-[a-z]{2,4}(\.\d+)?".into());
        let text = h.walk(&mut h.compile(spec), seed);
        assert!(re.is_match(&text), "seed {seed}: {text:?}");
    }
    let choices = vec![
        "yes".to_string(),
        "no".into(),
        "maybe not".into(),
        "日本".into(),
    ];
    for seed in 0..6 {
        let text = h.walk(&mut h.compile(GrammarSpec::Choice(choices.clone())), seed);
        assert!(choices.contains(&text), "seed {seed}: {text:?}");
    }
}

#[test]
fn gbnf_and_lark_grammars_constrain() {
    let h = Harness::new(&SMOLLM2);
    let gbnf = "root ::= item (\", \" item)*\nitem ::= [a-z]+ \"=\" [0-9]{1,3}\n";
    let lark = "start: item (\", \" item)*\nitem: /[a-z]+/ \"=\" /[0-9]{1,3}/\n";
    let re = regex::Regex::new(r"^[a-z]+=[0-9]{1,3}(, [a-z]+=[0-9]{1,3})*$").unwrap();
    for grammar in [gbnf, lark] {
        for seed in 0..4 {
            let text = h.walk(&mut h.compile(GrammarSpec::Grammar(grammar.into())), seed);
            assert!(re.is_match(&text), "{grammar:?} seed {seed}: {text:?}");
        }
    }
}

#[test]
fn structural_tag_constrains_the_tagged_section() {
    let h = Harness::new(&QWEN2);
    let tag = json!({"type": "structural_tag",
        "structures": [{"begin": "<function=get_weather>",
                        "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"], "additionalProperties": false},
                        "end": "</function>"}],
        "triggers": ["<function="]});
    let mut m = h.compile(GrammarSpec::StructuralTag(tag));
    // Free text, then the trigger: from there on the tag's grammar holds.
    for id in h.tok.encode("Let me check. <function=", false).unwrap() {
        m.consume_token(id)
            .expect("free text and trigger are allowed");
    }
    let mut mask = vec![0u32; h.compiler.bitmask_words()];
    m.fill_next_token_bitmask(&mut mask).unwrap();
    let allowed = h.allowed(&mask);
    let texts: Vec<String> = allowed
        .iter()
        .map(|&t| h.tok.decode(&[t], false).unwrap())
        .collect();
    assert!(
        texts
            .iter()
            .all(|t| "get_weather>".starts_with(t.as_str()) && !t.is_empty()),
        "after the trigger only the rest of `begin` may follow: {texts:?}"
    );
    let begin = h.tok.encode("get_weather>", false).unwrap();
    for id in begin {
        m.consume_token(id).unwrap();
    }
    let body: Vec<u32> = h
        .tok
        .encode(r#"{"city": "Paris"}</function>"#, false)
        .unwrap();
    for id in body {
        m.consume_token(id)
            .expect("the schema's JSON and the end are allowed");
    }
    // A body that breaks the schema is refused.
    let mut m2 = h.compile(GrammarSpec::StructuralTag(json!({
        "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
        "triggers": ["<f>"]})));
    for id in h.tok.encode("<f>", false).unwrap() {
        m2.consume_token(id).unwrap();
    }
    let bad = h.tok.encode("\"x\"", false).unwrap()[0];
    assert!(matches!(
        m2.consume_token(bad),
        Err(MatchError::TokenRejected { .. })
    ));
}

#[test]
fn invalid_specs_are_errors_naming_the_problem() {
    let h = Harness::new(&SMOLLM2);
    type IsKind = fn(&GrammarError) -> bool;
    let cases: Vec<(GrammarSpec, IsKind)> = vec![
        (GrammarSpec::JsonSchema(json!({"type": "nonsense"})), |e| {
            matches!(e, GrammarError::JsonSchema(_))
        }),
        (
            GrammarSpec::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
            |e| matches!(e, GrammarError::JsonSchema(_)),
        ),
        (GrammarSpec::JsonSchema(json!([1, 2])), |e| {
            matches!(e, GrammarError::JsonSchema(_))
        }),
        (GrammarSpec::Regex("(unclosed".into()), |e| {
            matches!(e, GrammarError::Regex(_))
        }),
        (GrammarSpec::Grammar("start: missing_rule".into()), |e| {
            matches!(e, GrammarError::Grammar(_))
        }),
        (GrammarSpec::Grammar("root ::= undefined".into()), |e| {
            matches!(e, GrammarError::Grammar(_))
        }),
        (GrammarSpec::Choice(vec![]), |e| {
            matches!(e, GrammarError::Choice(_))
        }),
        (
            GrammarSpec::StructuralTag(json!({"structures": [
                {"begin": "<x>", "schema": {}, "end": "</x>"}], "triggers": ["<y"]})),
            |e| matches!(e, GrammarError::StructuralTag(_)),
        ),
    ];
    for (spec, is_expected_kind) in cases {
        let err = match h.compiler.compile(&spec) {
            Ok(_) => panic!("{spec:?} compiled"),
            Err(e) => e,
        };
        assert!(is_expected_kind(&err), "{spec:?}: wrong kind {err:?}");
        assert!(err.is_client_error());
        assert!(
            err.to_string().len() > 20,
            "{spec:?}: message too thin: {err}"
        );
    }
}

#[test]
fn compilation_is_cached_per_spec() {
    let h = Harness::new(&SMOLLM2);
    let spec = GrammarSpec::JsonSchema(
        json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
    );
    let a = h.compiler.compile(&spec).unwrap();
    let b = h.compiler.compile(&spec).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    let c = h
        .compiler
        .compile(&GrammarSpec::Regex("a+".into()))
        .unwrap();
    assert!(!Arc::ptr_eq(&a, &c));
    assert_eq!(h.compiler.cached(), 2);
}

#[test]
fn padded_vocab_ids_are_never_allowed_and_eos_ends_a_finished_grammar() {
    let tok: &TextTokenizer = &SMOLLM2;
    let padded = tok.vocab_size() + 77;
    let compiler = GrammarCompiler::new(tok, padded).unwrap();
    // A mask buffer longer than needed: the extra words are zeroed.
    let mut mask = vec![u32::MAX; compiler.bitmask_words() + 2];
    let mut m = compiler
        .compile(&GrammarSpec::Regex("[a-z ]+".into()))
        .unwrap()
        .matcher();
    m.fill_next_token_bitmask(&mut mask).unwrap();
    for id in tok.vocab_size()..mask.len() * 32 {
        assert_eq!(mask[id / 32] >> (id % 32) & 1, 0, "id {id} allowed");
    }
    assert!(matches!(
        m.fill_next_token_bitmask(&mut [0u32; 3]),
        Err(MatchError::BitmaskTooSmall { .. })
    ));

    let mut done = compiler
        .compile(&GrammarSpec::Choice(vec!["ok".into()]))
        .unwrap()
        .matcher();
    for id in tok.encode("ok", false).unwrap() {
        done.consume_token(id).unwrap();
    }
    assert!(done.is_finished());
    done.fill_next_token_bitmask(&mut mask).unwrap();
    let allowed: Vec<usize> = (0..padded)
        .filter(|&id| mask[id / 32] >> (id % 32) & 1 == 1)
        .collect();
    let mut eos: Vec<usize> = compiler
        .eos_token_ids()
        .iter()
        .map(|&e| e as usize)
        .collect();
    eos.sort_unstable();
    assert_eq!(allowed, eos);
}

#[test]
fn disallowed_token_is_rejected_and_rollback_restores_the_mask() {
    let h = Harness::new(&LLAMA3);
    let mut m = h.compile(GrammarSpec::JsonSchema(
        json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
    ));
    let mut first = vec![0u32; h.compiler.bitmask_words()];
    m.fill_next_token_bitmask(&mut first).unwrap();
    let ids = h.tok.encode("{\"n\": 1", false).unwrap();
    for &id in &ids {
        m.consume_token(id).unwrap();
    }
    m.rollback(ids.len()).unwrap();
    let mut again = vec![0u32; h.compiler.bitmask_words()];
    m.fill_next_token_bitmask(&mut again).unwrap();
    assert_eq!(first, again);

    let letter = h.tok.encode("x", false).unwrap()[0];
    assert!(matches!(
        m.consume_token(letter),
        Err(MatchError::TokenRejected { token, .. }) if token == letter
    ));
}

#[test]
fn required_tool_choice_walks_parse_into_valid_calls() {
    use tokenspeed_structured::tool_call::forced;
    use tokenspeed_structured::ToolCallFormat;
    let h = Harness::new(&LLAMA3);
    let weather = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false});
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": weather}}),
        json!({"type": "function", "function": {"name": "now", "parameters":
            {"type": "object", "properties": {}, "additionalProperties": false}}}),
    ];
    let spec = GrammarSpec::JsonSchema(forced::required_schema(&tools, true).unwrap());
    for seed in 0..4 {
        let text = h.walk(&mut h.compile(spec.clone()), seed);
        let parsed = ToolCallFormat::JsonArray.parse(&text);
        assert!(!parsed.tool_calls.is_empty(), "seed {seed}: {text:?}");
        for call in parsed.tool_calls {
            let schema = forced::named_schema(&tools, &call.name).expect("a known tool");
            let args = parse_json(&call.arguments).expect("arguments are JSON");
            assert!(
                jsonschema::is_valid(&schema, &args),
                "seed {seed}: {} {} breaks its schema",
                call.name,
                call.arguments
            );
        }
    }
}

#[test]
fn sentencepiece_byte_fallback_vocabularies_constrain_too() {
    for (name, tok) in [
        ("spm-legacy", &*SPM_LEGACY),
        ("spm-metaspace", &*SPM_METASPACE),
    ] {
        let h = Harness::new(tok);
        let choices = vec![
            "Hello world".to_string(),
            "the 中文 end".into(),
            "é, ñ!".into(),
        ];
        for seed in 0..6 {
            let text = h.walk(&mut h.compile(GrammarSpec::Choice(choices.clone())), seed);
            assert!(choices.contains(&text), "{name} seed {seed}: {text:?}");
        }
    }
}
