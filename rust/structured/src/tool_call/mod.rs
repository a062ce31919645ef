//! Tool-call parsers: split a model's output into content and tool calls, whole or streamed.
//!
//! Each format module writes one pure function, `snapshot(text, finished)`: what the text so far
//! says for sure (content that cannot turn out to be the start of a call; calls with their name
//! once it is complete and the arguments written so far). Non-streaming parsing is the snapshot
//! of the whole text; streaming diffs successive snapshots of the growing text, so both agree
//! by construction wherever each snapshot extends the previous one (the tests split recorded
//! outputs at every char boundary to check that).
//!
//! Arguments are the JSON text as the model wrote it (for `pythonic`, the JSON the Python
//! literals translate to), so streamed fragments concatenate to exactly the non-streamed value.
//! Special-token markers (`<|python_tag|>`, `[TOOL_CALLS]`, DeepSeek's and Kimi's) reach the parser only when the
//! request detokenizes with special tokens kept: do so when tools are in play.

pub mod forced;
mod hermes;
mod llama3_json;
mod mistral;
mod pythonic;
mod sectioned;

use crate::json_scan::{scan_object, Scan};

/// One complete tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// The whole output, parsed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ParsedToolCalls {
    /// Text outside tool calls, verbatim (whitespace-only content is the API layer's to drop).
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// A piece of one tool call in OpenAI's streaming shape: the first delta of call `index` has
/// the name, later ones argument fragments (the API layer adds the call id and type).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallDelta {
    pub index: usize,
    pub name: Option<String>,
    pub arguments: String,
}

/// What one streamed text delta adds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ToolStreamDelta {
    pub content: String,
    pub tool_calls: Vec<ToolCallDelta>,
}

impl ToolStreamDelta {
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.tool_calls.is_empty()
    }
}

/// `--tool-call-parser` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    /// Qwen2.5 / Qwen3 (and Hermes): `<tool_call>{"name": .., "arguments": ..}</tool_call>`.
    Hermes,
    /// Llama 3.1+: `{"name": .., "parameters": ..}` (after `<|python_tag|>` or not), `;`-separated.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS][{"name": .., "arguments": ..}, ..]` or `[TOOL_CALLS]name[ARGS]{..}`.
    Mistral,
    /// Llama 3.2 / 4 pythonic: `[f(a=1, b="x"), g()]`.
    Pythonic,
    /// DeepSeek-V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`
    /// then the arguments in a ```` ```json ```` fence, `<｜tool▁call▁end｜>` per call.
    DeepSeekV3,
    /// DeepSeek-V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{..}<｜tool▁call▁end｜>` in the same section.
    DeepSeekV31,
    /// Kimi-K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX`
    /// `<|tool_call_argument_begin|>{..}<|tool_call_end|>..<|tool_calls_section_end|>`.
    KimiK2,
    /// GPT-OSS harmony: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>`
    /// (`crate::harmony`); parsed alone, the reasoning is dropped (SGLang's `gpt-oss` does so).
    Harmony,
    /// `[{"name": .., "parameters": ..}, ..]`: the grammar-forced output of
    /// `tool_choice: "required"` (see `forced`), whatever the model's own format.
    JsonArray,
}

impl ToolCallFormat {
    pub const NAMES: [&'static str; 8] = [
        "hermes",
        "llama3_json",
        "mistral",
        "pythonic",
        "deepseekv3",
        "deepseekv31",
        "kimi_k2",
        "gpt-oss",
    ];

    /// The format for a `--tool-call-parser` value; `None` names an unknown parser.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "hermes" | "qwen25" | "qwen3" => ToolCallFormat::Hermes,
            "llama3_json" | "llama3" | "llama4_json" => ToolCallFormat::Llama3Json,
            "mistral" => ToolCallFormat::Mistral,
            "pythonic" | "llama4_pythonic" => ToolCallFormat::Pythonic,
            // SGLang's names, then vLLM's.
            "deepseekv3" | "deepseek_v3" => ToolCallFormat::DeepSeekV3,
            "deepseekv31" | "deepseek_v31" => ToolCallFormat::DeepSeekV31,
            "kimi_k2" => ToolCallFormat::KimiK2,
            // vLLM names its harmony tool parser `openai`.
            "gpt-oss" | "gpt_oss" | "openai" => ToolCallFormat::Harmony,
            _ => return None,
        })
    }

    fn snapshot(self, text: &str, finished: bool) -> Snapshot {
        match self {
            ToolCallFormat::Hermes => hermes::snapshot(text, finished),
            ToolCallFormat::Llama3Json => llama3_json::snapshot(text, finished),
            ToolCallFormat::Mistral => mistral::snapshot(text, finished),
            ToolCallFormat::Pythonic => pythonic::snapshot(text, finished),
            ToolCallFormat::DeepSeekV3 => {
                sectioned::snapshot(&sectioned::DEEPSEEK_V3, text, finished)
            }
            ToolCallFormat::DeepSeekV31 => {
                sectioned::snapshot(&sectioned::DEEPSEEK_V31, text, finished)
            }
            ToolCallFormat::KimiK2 => sectioned::snapshot(&sectioned::KIMI_K2, text, finished),
            ToolCallFormat::JsonArray => forced::snapshot(text, finished),
            ToolCallFormat::Harmony => {
                let snap = crate::harmony::snapshot(text, true, finished);
                Snapshot {
                    content: snap.content,
                    calls: snap.calls,
                }
            }
        }
    }

    /// Parses a whole output. Calls whose name never completed are dropped.
    pub fn parse(self, text: &str) -> ParsedToolCalls {
        let snap = self.snapshot(text, true);
        ParsedToolCalls {
            content: snap.content,
            tool_calls: snap
                .calls
                .into_iter()
                .filter_map(CallSnapshot::into_call)
                .collect(),
        }
    }

    /// A parser for one streamed response.
    pub fn stream(self) -> ToolCallStream {
        ToolCallStream {
            format: self,
            text: String::new(),
            sent_content: String::new(),
            sent_calls: CallDiff::default(),
        }
    }
}

/// What a text prefix says for sure.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Snapshot {
    pub content: String,
    pub calls: Vec<CallSnapshot>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct CallSnapshot {
    /// Known once complete.
    pub name: Option<String>,
    /// The arguments' JSON text so far (complete once the call is).
    pub arguments: String,
}

impl CallSnapshot {
    /// The finished call of a whole output; None while its name never completed.
    pub(crate) fn into_call(self) -> Option<ToolCall> {
        let arguments = self.arguments;
        self.name.map(|name| ToolCall { name, arguments })
    }
}

/// Streaming state: the text so far and what has been sent of its snapshot.
pub struct ToolCallStream {
    format: ToolCallFormat,
    text: String,
    sent_content: String,
    sent_calls: CallDiff,
}

impl ToolCallStream {
    /// Feeds the next text delta; returns what can be sent now.
    pub fn push(&mut self, delta: &str) -> ToolStreamDelta {
        self.text.push_str(delta);
        let snap = self.format.snapshot(&self.text, false);
        self.diff(snap)
    }

    /// The output ended: returns whatever was held back.
    pub fn finish(&mut self) -> ToolStreamDelta {
        let snap = self.format.snapshot(&self.text, true);
        self.diff(snap)
    }

    /// Sends what `snap` adds to what was sent. A snapshot that contradicts what was sent (only
    /// malformed outputs do that) sends nothing for that part: sent text cannot be recalled.
    fn diff(&mut self, snap: Snapshot) -> ToolStreamDelta {
        ToolStreamDelta {
            content: diff_text(&mut self.sent_content, snap.content),
            tool_calls: self.sent_calls.diff(snap.calls),
        }
    }
}

/// What `snap` adds to `sent` (then `sent` is `snap`); nothing if `snap` does not extend it.
pub(crate) fn diff_text(sent: &mut String, snap: String) -> String {
    match snap.strip_prefix(sent.as_str()) {
        Some(new) => {
            let new = new.to_string();
            *sent = snap;
            new
        }
        None => String::new(),
    }
}

/// The calls sent so far of a stream: per call, whether its name was sent and how many bytes
/// of its arguments.
#[derive(Debug, Default)]
pub(crate) struct CallDiff(Vec<(bool, usize)>);

impl CallDiff {
    /// The deltas that bring what was sent up to `calls` (a call's name first, as OpenAI does).
    pub fn diff(&mut self, calls: Vec<CallSnapshot>) -> Vec<ToolCallDelta> {
        let mut out = Vec::new();
        for (index, call) in calls.into_iter().enumerate() {
            if self.0.len() <= index {
                self.0.push((false, 0));
            }
            let Some(name) = call.name else {
                continue; // arguments wait for the name: OpenAI streams the name first
            };
            let (name_sent, args_sent) = &mut self.0[index];
            let mut delta = ToolCallDelta {
                index,
                name: None,
                arguments: String::new(),
            };
            if !*name_sent {
                delta.name = Some(name);
                *name_sent = true;
            }
            if call.arguments.len() > *args_sent && call.arguments.is_char_boundary(*args_sent) {
                delta.arguments = call.arguments[*args_sent..].to_string();
                *args_sent = call.arguments.len();
            }
            if delta.name.is_some() || !delta.arguments.is_empty() {
                out.push(delta);
            }
        }
        out
    }
}

/// Length of the prefix of `text` that cannot be the start of any of `markers`: a suffix that
/// is a proper prefix of a marker is held back until the next delta decides it.
pub(crate) fn stable_len(text: &str, markers: &[&str]) -> usize {
    let mut keep = text.len();
    for marker in markers {
        for (start, _) in text.char_indices() {
            let tail = &text[start..];
            if tail.len() < marker.len() && marker.starts_with(tail) {
                keep = keep.min(start);
                break;
            }
        }
    }
    keep
}

/// Whether `text` (not yet finished) could still become something starting with `marker`.
pub(crate) fn may_become(text: &str, marker: &str) -> bool {
    text.len() < marker.len() && marker.starts_with(text)
}

/// A `{"name": .., <args_key>: ..}` object at byte `i` of `text`: the call as far as written,
/// and how the object scan ended.
pub(crate) fn json_call(text: &str, i: usize, args_keys: &[&str]) -> (CallSnapshot, Scan) {
    let bytes = text.as_bytes();
    let obj = scan_object(bytes, i);
    let status = if obj.invalid {
        Scan::Invalid
    } else {
        obj.end.map_or(Scan::Incomplete, Scan::Complete)
    };
    let mut call = CallSnapshot::default();
    for field in &obj.fields {
        let raw = |end: usize| &text[field.value_start..end];
        if field.key == "name" {
            if let Some(end) = field.value_end {
                call.name = serde_json::from_str::<String>(raw(end)).ok();
            }
        } else if args_keys.contains(&field.key.as_str()) {
            call.arguments = match field.value_end {
                // Arguments sent as a JSON string holding JSON: the string's content.
                Some(end) if bytes[field.value_start] == b'"' => {
                    serde_json::from_str::<String>(raw(end)).unwrap_or_default()
                }
                Some(end) => raw(end).to_string(),
                None if bytes[field.value_start] == b'"' => String::new(),
                None => raw(text.len()).to_string(),
            };
        }
    }
    if matches!(status, Scan::Complete(_))
        && !obj
            .fields
            .iter()
            .any(|f| args_keys.contains(&f.key.as_str()))
    {
        call.arguments = "{}".into();
    }
    (call, status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_len_holds_back_a_marker_prefix() {
        assert_eq!(stable_len("hello <tool", &["<tool_call>"]), 6);
        assert_eq!(stable_len("hello", &["<tool_call>"]), 5);
        assert_eq!(stable_len("a < b", &["<tool_call>"]), 5);
        assert_eq!(stable_len("é[TOOL", &["[TOOL_CALLS]"]), 2);
    }
}
