//! Request forms that llguidance does not take directly, written as llguidance Lark: a choice
//! list, SGLang's structural_tag, and GBNF/EBNF grammars (`rule ::= ...`, as xgrammar and
//! llama.cpp spell them). Errors are plain messages; the caller wraps them in the right kind.

use serde_json::Value as Json;
use std::collections::{HashMap, HashSet};

/// A Lark string literal (llguidance reads them with JSON string syntax).
fn literal(s: &str) -> String {
    Json::from(s).to_string()
}

/// `start: "a" | "b" | ...`
pub(crate) fn choice_to_lark(choices: &[String]) -> Result<String, String> {
    if choices.is_empty() {
        return Err("at least one choice is needed".into());
    }
    let alternatives: Vec<String> = choices.iter().map(|c| literal(c)).collect();
    Ok(format!("start: {}\n", alternatives.join(" | ")))
}

/// SGLang's `{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers"}`:
/// free text, in which each trigger string starts one of the structures whose `begin` it
/// prefixes; the structure's body follows its JSON schema and ends with `end`. Written as the
/// lazy-lexeme pattern of llguidance's docs ("Tool calling"), as llguidance's own `StructTag` does.
pub(crate) fn structural_tag_to_lark(tag: &Json) -> Result<String, String> {
    let obj = tag
        .as_object()
        .ok_or("expected an object with \"structures\" and \"triggers\"")?;
    if let Some(kind) = obj.get("type").and_then(Json::as_str) {
        if kind != "structural_tag" {
            return Err(format!("\"type\" is {kind:?}, expected \"structural_tag\""));
        }
    }
    if obj.contains_key("format") {
        return Err(
            "the \"format\" form of structural tags is not supported; use \"structures\" and \"triggers\""
                .into(),
        );
    }
    let structures = obj
        .get("structures")
        .and_then(Json::as_array)
        .filter(|s| !s.is_empty())
        .ok_or("\"structures\" must be a non-empty array")?;
    let triggers: Vec<&str> = obj
        .get("triggers")
        .and_then(Json::as_array)
        .ok_or("\"triggers\" must be an array of strings")?
        .iter()
        .map(|t| t.as_str().filter(|t| !t.is_empty()))
        .collect::<Option<_>>()
        .ok_or("\"triggers\" must be non-empty strings")?;

    let mut rules = Vec::new();
    let mut names = Vec::new();
    for (i, s) in structures.iter().enumerate() {
        let field = |key: &str| {
            s.get(key)
                .and_then(Json::as_str)
                .ok_or(format!("structures[{i}].{key} must be a string"))
        };
        let (begin, end) = (field("begin")?, field("end")?);
        let schema = s
            .get("schema")
            .filter(|v| v.is_object() || v.is_boolean())
            .ok_or(format!(
                "structures[{i}].schema must be a JSON schema object"
            ))?;
        let trigger = triggers
            .iter()
            .find(|t| begin.starts_with(**t))
            .ok_or(format!(
                "structures[{i}].begin {begin:?} starts with none of the triggers {triggers:?}"
            ))?;
        let rest = &begin[trigger.len()..];
        let rest = if rest.is_empty() {
            String::new()
        } else {
            literal(rest)
        };
        rules.push(format!("tag_{i}_head[lazy]: TEXT {}", literal(trigger)));
        rules.push(format!(
            "tag_{i}: tag_{i}_head {rest} %json {schema} {}",
            literal(end)
        ));
        names.push(format!("tag_{i}"));
    }
    Ok(format!(
        "start: ({})* TEXT\nTEXT: /(.|\\n)*/\n{}\n",
        names.join(" | "),
        rules.join("\n")
    ))
}

/// A grammar in Lark passes through; one with `::=` rules (GBNF/EBNF) is translated.
pub(crate) fn grammar_to_lark(text: &str) -> Result<String, String> {
    if text.trim().is_empty() {
        return Err("the grammar is empty".into());
    }
    if text.contains("::=") {
        Gbnf::parse(text)?.to_lark()
    } else {
        Ok(text.to_string())
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Define,
    /// A string literal, escapes resolved.
    Str(String),
    /// A character class as a Rust regex (`[...]`) or `.`.
    Class(String),
    Open,
    Close,
    Bar,
    /// `*`, `+`, `?` or `{m,n}` as written.
    Repeat(String),
}

/// A GBNF grammar: rules in order, the first `root` is the start.
struct Gbnf {
    rules: Vec<(String, Vec<Tok>)>,
}

/// One escape after a backslash inside a GBNF string or class: returns the char.
fn escape(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) -> Result<char, String> {
    let c = chars.next().ok_or("a backslash ends the grammar")?;
    let hex = |chars: &mut std::iter::Peekable<std::str::Chars<'_>>, n: usize| {
        let digits: String = (0..n).filter_map(|_| chars.next()).collect();
        u32::from_str_radix(&digits, 16)
            .ok()
            .and_then(char::from_u32)
            .ok_or(format!("bad escape \\{c}{digits}"))
    };
    Ok(match c {
        'n' => '\n',
        't' => '\t',
        'r' => '\r',
        'x' => hex(chars, 2)?,
        'u' => hex(chars, 4)?,
        'U' => hex(chars, 8)?,
        other => other, // \\ \" \] \[ \- \^ and the like stand for themselves
    })
}

/// A char inside a regex class, escaped so no char of it means anything to the regex or to
/// Lark's `/.../` delimiters.
fn class_char(c: char) -> String {
    if c.is_ascii_alphanumeric() {
        c.to_string()
    } else {
        format!("\\x{{{:X}}}", c as u32)
    }
}

type Chars<'a> = std::iter::Peekable<std::str::Chars<'a>>;

/// A string literal's text, after its opening `quote`.
fn lex_string(chars: &mut Chars<'_>, quote: char) -> Result<String, String> {
    let mut s = String::new();
    loop {
        match chars.next().ok_or("unterminated string literal")? {
            '\\' => s.push(escape(chars)?),
            q if q == quote => return Ok(s),
            other => s.push(other),
        }
    }
}

/// A character class, after its `[`, as a regex class.
fn lex_class(chars: &mut Chars<'_>) -> Result<String, String> {
    let mut class = String::from("[");
    if chars.peek() == Some(&'^') {
        chars.next();
        class.push('^');
    }
    loop {
        match chars.next().ok_or("unterminated character class")? {
            ']' => break,
            '-' => class.push('-'),
            '\\' => class.push_str(&class_char(escape(chars)?)),
            other => class.push_str(&class_char(other)),
        }
    }
    class.push(']');
    Ok(class)
}

/// A `{m,n}` repetition, after its `{`, without spaces.
fn lex_repetition(chars: &mut Chars<'_>) -> Result<String, String> {
    let mut rep = String::from("{");
    loop {
        let c = chars.next().ok_or("unterminated {m,n}")?;
        if !(c.is_ascii_digit() || c == ',' || c == ' ' || c == '}') {
            return Err(format!("unexpected {c:?} in a {{m,n}} repetition"));
        }
        if c != ' ' {
            rep.push(c);
        }
        if c == '}' {
            return Ok(rep);
        }
    }
}

impl Gbnf {
    fn lex(text: &str) -> Result<Vec<Tok>, String> {
        let mut toks = Vec::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                c if c.is_whitespace() => {}
                '#' => {
                    for c in chars.by_ref() {
                        if c == '\n' {
                            break;
                        }
                    }
                }
                ':' => {
                    if chars.next() != Some(':') || chars.next() != Some('=') {
                        return Err("':' outside '::='".into());
                    }
                    toks.push(Tok::Define);
                }
                '"' | '\'' => toks.push(Tok::Str(lex_string(&mut chars, c)?)),
                '[' => toks.push(Tok::Class(lex_class(&mut chars)?)),
                '.' => toks.push(Tok::Class("(?s:.)".into())),
                '(' => toks.push(Tok::Open),
                ')' => toks.push(Tok::Close),
                '|' => toks.push(Tok::Bar),
                '*' | '+' | '?' => toks.push(Tok::Repeat(c.to_string())),
                '{' => toks.push(Tok::Repeat(lex_repetition(&mut chars)?)),
                c if c.is_alphanumeric() || c == '_' || c == '-' => {
                    let mut name = c.to_string();
                    while let Some(&n) = chars.peek() {
                        if n.is_alphanumeric() || n == '_' || n == '-' {
                            name.push(n);
                            chars.next();
                        } else {
                            break;
                        }
                    }
                    toks.push(Tok::Name(name));
                }
                other => return Err(format!("unexpected character {other:?}")),
            }
        }
        Ok(toks)
    }

    fn parse(text: &str) -> Result<Self, String> {
        let toks = Self::lex(text)?;
        let mut rules: Vec<(String, Vec<Tok>)> = Vec::new();
        let mut i = 0;
        while i < toks.len() {
            // A rule starts at `name ::=` and runs until the next one.
            if let (Tok::Name(name), Some(Tok::Define)) = (&toks[i], toks.get(i + 1)) {
                rules.push((name.clone(), Vec::new()));
                i += 2;
                continue;
            }
            match rules.last_mut() {
                Some((_, body)) => body.push(toks[i].clone()),
                None => return Err("the grammar must start with a rule (`name ::= ...`)".into()),
            }
            i += 1;
        }
        let defined: HashSet<&str> = rules.iter().map(|(n, _)| n.as_str()).collect();
        if !defined.contains("root") {
            return Err("no `root` rule: the grammar starts at `root ::= ...`".into());
        }
        for (name, body) in &rules {
            if body.is_empty() {
                return Err(format!("rule `{name}` is empty"));
            }
            for t in body {
                if let Tok::Name(r) = t {
                    if !defined.contains(r.as_str()) {
                        return Err(format!("rule `{name}` refers to undefined rule `{r}`"));
                    }
                }
            }
        }
        Ok(Self { rules })
    }

    /// Rules that reference only terminals and other such rules, with no recursion: they become
    /// Lark terminals (one regex each), which llguidance matches far faster than rules of
    /// single characters. The lexer is greedy within a terminal, as llguidance's own GBNF
    /// converter is.
    fn regular_rules(&self) -> HashSet<String> {
        let bodies: HashMap<&str, &Vec<Tok>> =
            self.rules.iter().map(|(n, b)| (n.as_str(), b)).collect();
        let mut regular = HashSet::new();
        // Fixed point: a rule is regular once everything it names is; cycles never qualify.
        loop {
            let before = regular.len();
            for (name, body) in &bodies {
                if name != &"root"
                    && !regular.contains(*name)
                    && body.iter().all(|t| match t {
                        Tok::Name(r) => regular.contains(r.as_str()),
                        _ => true,
                    })
                {
                    regular.insert(name.to_string());
                }
            }
            if regular.len() == before {
                return regular;
            }
        }
    }

    fn to_lark(&self) -> Result<String, String> {
        let regular = self.regular_rules();
        let lark_name = |name: &str| {
            if name == "root" {
                return "start".to_string();
            }
            let safe: String = name
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            if regular.contains(name) {
                format!("T_{}", safe.to_ascii_uppercase())
            } else {
                format!("r_{}", safe.to_ascii_lowercase())
            }
        };
        let mut seen = HashMap::new();
        let mut out = String::new();
        for (name, body) in &self.rules {
            let lname = lark_name(name);
            if let Some(other) = seen.insert(lname.clone(), name) {
                if other != name {
                    return Err(format!("rules `{other}` and `{name}` differ only in case"));
                }
                return Err(format!("rule `{name}` is defined twice"));
            }
            let parts: Vec<String> = body
                .iter()
                .map(|t| match t {
                    Tok::Name(r) => lark_name(r),
                    Tok::Define => unreachable!("split on ::= while parsing"),
                    Tok::Str(s) => literal(s),
                    Tok::Class(c) => format!("/{c}/"),
                    Tok::Open => "(".into(),
                    Tok::Close => ")".into(),
                    Tok::Bar => "|".into(),
                    Tok::Repeat(r) => r.clone(),
                })
                .collect();
            out.push_str(&format!("{lname}: {}\n", parts.join(" ")));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gbnf_rules_become_lark_with_terminals_for_regular_rules() {
        let lark = grammar_to_lark(
            "root ::= greeting (\", \" name)*\n# a comment\ngreeting ::= \"hi\" | \"hello\"\nname ::= [A-Z] [a-z]+\n",
        )
        .unwrap();
        assert_eq!(
            lark,
            "start: T_GREETING ( \", \" T_NAME ) *\nT_GREETING: \"hi\" | \"hello\"\nT_NAME: /[A-Z]/ /[a-z]/ +\n"
        );
    }

    #[test]
    fn gbnf_recursive_rules_stay_rules() {
        let lark = grammar_to_lark("root ::= list\nlist ::= \"[\" (list | \"x\")* \"]\"").unwrap();
        assert!(
            lark.contains("r_list: \"[\" ( r_list | \"x\" ) * \"]\""),
            "{lark}"
        );
    }

    #[test]
    fn gbnf_without_root_is_an_error() {
        let err = grammar_to_lark("start ::= \"a\"").unwrap_err();
        assert!(err.contains("root"), "{err}");
    }

    #[test]
    fn gbnf_undefined_rule_is_named() {
        let err = grammar_to_lark("root ::= missing").unwrap_err();
        assert!(err.contains("`missing`"), "{err}");
    }

    #[test]
    fn class_escapes_cannot_close_the_regex() {
        let lark = grammar_to_lark(r#"root ::= [^"/\]\n]+"#).unwrap();
        assert_eq!(lark, "start: /[^\\x{22}\\x{2F}\\x{5D}\\x{A}]/ +\n");
    }
}
