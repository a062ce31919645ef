//! The chat output stage: after detokenizing and stop matching (so text past a stop string never
//! reaches it), a choice's text is split into reasoning, content and tool calls: the reasoning
//! parser first (`--reasoning-parser`), its answer then through the tool-call parser (the model's
//! format for `tool_choice: "auto"`, the grammar-forced JSON array for "required", the whole
//! answer as the arguments for a named function). Non-streamed responses `parse` the final
//! text; streams push each chunk's text through an `OutputStream`. Both are built on the same
//! parsers and the same rules (whitespace-only content dropped when calls were made, a single
//! call kept without `parallel_tool_calls`), so streamed deltas reassemble to the non-streamed
//! message; the tests split recorded outputs at every byte boundary to check that.

use tokenspeed_structured::{
    ReasoningFormat, ReasoningStream, ToolCall, ToolCallDelta, ToolCallFormat, ToolCallStream,
    ToolStreamDelta,
};
use tokenspeed_text::TextTokenizer;

use crate::config::ServerConfig;

/// The parsers the server was started with, resolved once (unknown names fail at startup).
#[derive(Debug, Clone, Copy, Default)]
pub struct ChatParsers {
    /// `--tool-call-parser`: the model's own tool-call format (needed for "auto").
    pub tool_call: Option<ToolCallFormat>,
    /// `--reasoning-parser`.
    pub reasoning: Option<ReasoningFormat>,
    /// `--enable-auto-tool-choice`.
    pub auto_tool_choice: bool,
    /// The think-end marker's token id when it is one token: a grammar starts after it, so the
    /// reasoning stays unconstrained. None: grammars cannot follow reasoning on this model.
    pub think_end_id: Option<u32>,
}

impl ChatParsers {
    pub fn from_config(c: &ServerConfig, tokenizer: &TextTokenizer) -> Result<Self, String> {
        let tool_call = match c.tool_call_parser.as_deref() {
            None | Some("") => None,
            Some(name) => Some(ToolCallFormat::from_name(name).ok_or_else(|| {
                format!(
                    "--tool-call-parser {name:?} is not supported (one of {:?})",
                    ToolCallFormat::NAMES
                )
            })?),
        };
        let reasoning = match c.reasoning_parser.as_deref() {
            None | Some("") => None,
            Some(name) => Some(ReasoningFormat::from_name(name).ok_or_else(|| {
                format!(
                    "--reasoning-parser {name:?} is not supported (one of {:?})",
                    ReasoningFormat::NAMES
                )
            })?),
        };
        if c.enable_auto_tool_choice && tool_call.is_none() {
            return Err(
                "--enable-auto-tool-choice needs --tool-call-parser (which format the \
                        model writes tool calls in)"
                    .into(),
            );
        }
        let think_end_id = reasoning.and_then(|r| tokenizer.token_to_id(r.end_marker()));
        if let (Some(r), None) = (reasoning, think_end_id) {
            tracing::warn!(
                marker = r.end_marker(),
                "--reasoning-parser: the tokenizer has no single think-end token, so requests \
                 that start in reasoning cannot also ask for a grammar (structured output or \
                 tool_choice required/named)"
            );
        }
        Ok(ChatParsers {
            tool_call,
            reasoning,
            auto_tool_choice: c.enable_auto_tool_choice,
            think_end_id,
        })
    }
}

/// How one request's tool calls are read.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolMode {
    /// No tool parsing: no tools, or `tool_choice: "none"`.
    Off,
    /// Calls in `format` ("auto": the model's own; "required": the forced JSON array);
    /// `single`: without `parallel_tool_calls`, only the first call is kept.
    Parse {
        format: ToolCallFormat,
        single: bool,
    },
    /// A named `tool_choice`: the whole answer is this function's arguments.
    Named(String),
}

/// How one request's output is read, decided from the request and the server's parsers.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputStage {
    pub reasoning: Option<ReasoningFormat>,
    /// `chat_template_kwargs.enable_thinking` (None: the template's default).
    pub enable_thinking: Option<bool>,
    pub tools: ToolMode,
}

/// A whole answer, split. Empty strings are the API layer's to map to null.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedMessage {
    pub reasoning_content: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// What one streamed text delta adds (tool-call pieces in OpenAI's order: name, then arguments).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MessageDelta {
    pub reasoning_content: String,
    pub content: String,
    pub tool_calls: Vec<ToolCallDelta>,
}

impl MessageDelta {
    pub fn is_empty(&self) -> bool {
        self.reasoning_content.is_empty() && self.content.is_empty() && self.tool_calls.is_empty()
    }
}

impl OutputStage {
    /// Text goes through untouched (content only).
    pub fn is_passthrough(&self) -> bool {
        self.reasoning.is_none() && self.tools == ToolMode::Off
    }

    /// Whether output begins inside the reasoning (a grammar then starts after it).
    pub fn starts_in_reasoning(&self) -> bool {
        self.reasoning
            .is_some_and(|r| r.starts_in_reasoning(self.enable_thinking))
    }

    /// Splits a whole answer.
    pub fn parse(&self, text: &str) -> ParsedMessage {
        let mut out = ParsedMessage::default();
        let answer = match self.reasoning {
            Some(r) => {
                let split = r.parse(text, self.enable_thinking);
                out.reasoning_content = split.reasoning_content;
                split.content
            }
            None => text.to_string(),
        };
        match &self.tools {
            ToolMode::Off => out.content = answer,
            ToolMode::Parse { format, single } => {
                let parsed = format.parse(&answer);
                out.content = parsed.content;
                out.tool_calls = parsed.tool_calls;
                if *single {
                    out.tool_calls.truncate(1);
                }
            }
            ToolMode::Named(name) => out.tool_calls.push(ToolCall {
                name: name.clone(),
                arguments: answer,
            }),
        }
        if !out.tool_calls.is_empty() && out.content.trim().is_empty() {
            out.content.clear();
        }
        out
    }

    /// The state for streaming one choice.
    pub fn stream(&self) -> OutputStream {
        OutputStream {
            reasoning: self.reasoning.map(|r| r.stream(self.enable_thinking)),
            tools: match &self.tools {
                ToolMode::Off => ToolState::Off,
                ToolMode::Parse { format, single } => ToolState::Parse {
                    stream: format.stream(),
                    single: *single,
                },
                ToolMode::Named(name) => ToolState::Named {
                    name: name.clone(),
                    sent: false,
                },
            },
            answering: false,
            held_space: String::new(),
            content_started: false,
            calls: 0,
        }
    }
}

enum ToolState {
    Off,
    Parse {
        stream: ToolCallStream,
        single: bool,
    },
    Named {
        name: String,
        sent: bool,
    },
}

/// One streamed choice through the stage.
pub struct OutputStream {
    reasoning: Option<ReasoningStream>,
    tools: ToolState,
    /// The reasoning ended (or never began) and all it said was sent: the rest is answer.
    answering: bool,
    /// Whitespace-only content not sent yet: if the content stays whitespace-only and calls are
    /// made, it is dropped (as `parse` drops it).
    held_space: String,
    /// Content other than whitespace was seen: everything after it is sent as it comes.
    content_started: bool,
    /// Calls whose name was sent.
    calls: usize,
}

impl OutputStream {
    /// Feeds the next text chunk; `last`: the choice ends with it (held-back text is released).
    pub fn push(&mut self, text: &str, last: bool) -> MessageDelta {
        let mut out = MessageDelta::default();
        let answer = match &mut self.reasoning {
            // Past the think-end everything is the answer: skip re-reading the whole text.
            Some(_) if self.answering => text.to_string(),
            Some(r) => {
                let mut d = r.push(text);
                self.answering = r.reasoning_ended();
                if last {
                    let rest = r.finish();
                    d.reasoning_content.push_str(&rest.reasoning_content);
                    d.content.push_str(&rest.content);
                }
                out.reasoning_content = d.reasoning_content;
                d.content
            }
            None => text.to_string(),
        };
        let content = match &mut self.tools {
            ToolState::Off => answer,
            ToolState::Parse { stream, single } => {
                let mut d = stream.push(&answer);
                if last {
                    let rest = stream.finish();
                    d = merge(d, rest);
                }
                if *single {
                    d.tool_calls.retain(|c| c.index == 0);
                }
                self.calls += d.tool_calls.iter().filter(|c| c.name.is_some()).count();
                out.tool_calls = d.tool_calls;
                d.content
            }
            ToolState::Named { name, sent } => {
                if (!answer.is_empty() || last) && !*sent {
                    *sent = true;
                    self.calls = 1;
                    out.tool_calls.push(ToolCallDelta {
                        index: 0,
                        name: Some(name.clone()),
                        arguments: answer,
                    });
                } else if !answer.is_empty() {
                    out.tool_calls.push(ToolCallDelta {
                        index: 0,
                        name: None,
                        arguments: answer,
                    });
                }
                String::new()
            }
        };
        out.content = self.content(content, last);
        out
    }

    /// Whether any tool call was streamed (the finish reason is then "tool_calls").
    pub fn made_calls(&self) -> bool {
        self.calls > 0
    }

    fn content(&mut self, text: String, last: bool) -> String {
        if matches!(self.tools, ToolState::Off) || self.content_started {
            return text;
        }
        self.held_space.push_str(&text);
        if !self.held_space.trim().is_empty() {
            self.content_started = true;
            return std::mem::take(&mut self.held_space);
        }
        if last && self.calls == 0 {
            return std::mem::take(&mut self.held_space);
        }
        String::new()
    }
}

/// Two successive tool deltas as one, pieces of the same call joined (name first).
fn merge(mut a: ToolStreamDelta, b: ToolStreamDelta) -> ToolStreamDelta {
    a.content.push_str(&b.content);
    for call in b.tool_calls {
        match a.tool_calls.iter_mut().find(|c| c.index == call.index) {
            Some(prev) => {
                if prev.name.is_none() {
                    prev.name = call.name;
                }
                prev.arguments.push_str(&call.arguments);
            }
            None => a.tool_calls.push(call),
        }
    }
    a
}

/// The finish reason a choice reports: "tool_calls" when it ended normally having made calls.
pub fn finish_reason(reason: &'static str, made_calls: bool) -> &'static str {
    if made_calls && reason == "stop" {
        "tool_calls"
    } else {
        reason
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(reasoning: Option<&str>, thinking: Option<bool>, tools: ToolMode) -> OutputStage {
        OutputStage {
            reasoning: reasoning.map(|n| ReasoningFormat::from_name(n).expect("format")),
            enable_thinking: thinking,
            tools,
        }
    }

    fn parse_mode(name: &str) -> ToolMode {
        ToolMode::Parse {
            format: ToolCallFormat::from_name(name).expect("format"),
            single: false,
        }
    }

    /// The stream's deltas, reassembled the way an OpenAI client does.
    fn reassemble(stage: &OutputStage, pieces: &[&str]) -> (ParsedMessage, bool) {
        let mut s = stage.stream();
        let mut out = ParsedMessage::default();
        let apply = |d: MessageDelta, out: &mut ParsedMessage| {
            out.reasoning_content.push_str(&d.reasoning_content);
            out.content.push_str(&d.content);
            for c in d.tool_calls {
                if let Some(name) = c.name {
                    assert_eq!(
                        c.index,
                        out.tool_calls.len(),
                        "a call's first delta names it"
                    );
                    out.tool_calls.push(ToolCall {
                        name,
                        arguments: String::new(),
                    });
                }
                let call = out
                    .tool_calls
                    .get_mut(c.index)
                    .expect("named before arguments");
                call.arguments.push_str(&c.arguments);
            }
        };
        for (i, p) in pieces.iter().enumerate() {
            let d = s.push(p, i + 1 == pieces.len());
            apply(d, &mut out);
        }
        (out, s.made_calls())
    }

    /// Every split of `text` in two (at each char boundary) and byte-wise pieces stream to the
    /// non-streamed parse.
    fn check_splits(stage: &OutputStage, text: &str) -> ParsedMessage {
        let whole = stage.parse(text);
        let (one, calls) = reassemble(stage, &[text]);
        assert_eq!(one, whole, "one chunk: {text:?}");
        assert_eq!(calls, !whole.tool_calls.is_empty());
        for (cut, _) in text.char_indices().skip(1) {
            let (two, _) = reassemble(stage, &[&text[..cut], &text[cut..]]);
            assert_eq!(two, whole, "split at {cut}: {text:?}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        if !pieces.is_empty() {
            let (each, _) = reassemble(stage, &pieces);
            assert_eq!(each, whole, "char by char: {text:?}");
        }
        // A final empty chunk (a finish arriving after the text) changes nothing.
        let mut with_end = pieces.clone();
        with_end.push("");
        assert_eq!(reassemble(stage, &with_end).0, whole);
        whole
    }

    const HERMES: &str = "<think>The user wants Paris weather.</think>\n\n<tool_call>\n{\"name\": \
        \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"°C\"}}\n</tool_call>\n\
        <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";

    #[test]
    fn reasoning_then_hermes_calls() {
        let s = stage(Some("qwen3"), None, parse_mode("hermes"));
        let m = check_splits(&s, HERMES);
        assert_eq!(m.reasoning_content, "The user wants Paris weather.");
        assert_eq!(m.content, "", "whitespace between calls is dropped");
        assert_eq!(m.tool_calls.len(), 2);
        assert_eq!(m.tool_calls[0].name, "get_weather");
        let args: serde_json::Value =
            serde_json::from_str(&m.tool_calls[0].arguments).expect("json arguments");
        assert_eq!(args["unit"], "°C");
        assert_eq!(m.tool_calls[1].arguments, "{}");
    }

    #[test]
    fn single_call_without_parallel_tool_calls() {
        let s = OutputStage {
            tools: ToolMode::Parse {
                format: ToolCallFormat::Hermes,
                single: true,
            },
            ..stage(Some("qwen3"), None, ToolMode::Off)
        };
        let m = check_splits(&s, HERMES);
        assert_eq!(m.tool_calls.len(), 1);
    }

    #[test]
    fn content_around_calls_is_kept() {
        let s = stage(None, None, parse_mode("hermes"));
        let text =
            "Let me check.\n<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>\n";
        let m = check_splits(&s, text);
        // (the parser drops the whitespace that separates calls from the text)
        assert_eq!(m.content, "Let me check.\n");
        assert_eq!(m.tool_calls[0].arguments, "{\"a\": 1}");
    }

    #[test]
    fn no_calls_leaves_content_and_whitespace() {
        let s = stage(None, None, parse_mode("hermes"));
        assert_eq!(check_splits(&s, "  \n").content, "  \n");
        let m = check_splits(&s, "Paris is the capital. <tool");
        assert_eq!(m.content, "Paris is the capital. <tool");
        assert!(m.tool_calls.is_empty());
    }

    #[test]
    fn required_json_array() {
        let s = stage(
            None,
            None,
            ToolMode::Parse {
                format: ToolCallFormat::JsonArray,
                single: false,
            },
        );
        let text = "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Par\\\"is\"}}, \
                    {\"name\": \"get_time\", \"parameters\": {\"tz\": [1, 2]}}]";
        let m = check_splits(&s, text);
        assert_eq!(m.content, "");
        assert_eq!(m.tool_calls.len(), 2);
        assert_eq!(m.tool_calls[1].arguments, "{\"tz\": [1, 2]}");
    }

    #[test]
    fn named_function_takes_the_whole_answer() {
        let named = ToolMode::Named("get_weather".into());
        let m = check_splits(&stage(None, None, named.clone()), "{\"city\": \"Oslo\"}");
        assert_eq!(m.tool_calls[0].name, "get_weather");
        assert_eq!(m.tool_calls[0].arguments, "{\"city\": \"Oslo\"}");
        // After reasoning: only the answer is the arguments.
        let m = check_splits(
            &stage(Some("deepseek-r1"), None, named.clone()),
            "hmm</think>{\"city\": \"Oslo\"}",
        );
        assert_eq!(m.reasoning_content, "hmm");
        assert_eq!(m.tool_calls[0].arguments, "{\"city\": \"Oslo\"}");
        // An empty answer still names the call (arguments empty).
        let m = check_splits(&stage(None, None, named), "");
        assert_eq!(m.tool_calls.len(), 1);
    }

    #[test]
    fn reasoning_only() {
        let r1 = stage(Some("deepseek-r1"), None, ToolMode::Off);
        let m = check_splits(&r1, "<think>2 + 2 is 4.</think>\n\nThe answer is 4.");
        assert_eq!(m.reasoning_content, "2 + 2 is 4.");
        assert_eq!(m.content, "\n\nThe answer is 4.");
        let m = check_splits(&r1, "still thinking </thi");
        assert_eq!(m.reasoning_content, "still thinking </thi");
        assert_eq!(m.content, "");
        // Qwen3 with thinking disabled: all content.
        let off = stage(Some("qwen3"), Some(false), ToolMode::Off);
        assert!(!off.starts_in_reasoning());
        let m = check_splits(&off, "no <think>here</think> x");
        assert_eq!(m.content, "no <think>here</think> x");
        assert!(stage(Some("qwen3"), None, ToolMode::Off).starts_in_reasoning());
    }

    #[test]
    fn finish_reason_reports_tool_calls_only_on_a_normal_end() {
        assert_eq!(finish_reason("stop", true), "tool_calls");
        assert_eq!(finish_reason("length", true), "length");
        assert_eq!(finish_reason("stop", false), "stop");
    }
}
