//! The chat output stage: after detokenizing and stop matching (so text past a stop string never
//! reaches it), a choice's text is split into reasoning, content and tool calls: the reasoning
//! parser first (`--reasoning-parser`), its answer then through the tool-call parser (the model's
//! format for `tool_choice: "auto"`, the grammar-forced JSON array for "required", the whole
//! answer as the arguments for a named function). Non-streamed responses `parse` the final
//! text; streams push each chunk's text through an `OutputStream`. Both are built on the same
//! parsers and the same rules (whitespace-only content dropped when calls were made, a single
//! call kept without `parallel_tool_calls`), so streamed deltas reassemble to the non-streamed
//! message; the tests split recorded outputs at every byte boundary to check that.
//!
//! GPT-OSS's harmony format carries reasoning, answer and calls in one channelled text, so
//! whichever of the two flags names it, one `harmony` parser reads the whole output: its
//! reasoning is reported with `--reasoning-parser gpt-oss` (dropped without, as SGLang's tool
//! parser does), its `functions.*` messages are calls when the request's tools are parsed.

use tokenspeed_structured::{
    harmony, HarmonyStream, ReasoningFormat, ReasoningStream, ToolCall, ToolCallDelta,
    ToolCallFormat, ToolCallStream, ToolStreamDelta,
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
    /// Whether the model writes GPT-OSS's harmony (either flag names it).
    pub fn harmony(&self) -> bool {
        self.reasoning == Some(ReasoningFormat::GptOss)
            || self.tool_call == Some(ToolCallFormat::Harmony)
    }

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
        check_harmony_pair(reasoning, tool_call)?;
        let think_end_id = reasoning
            .and_then(ReasoningFormat::end_marker)
            .and_then(|m| tokenizer.token_to_id(m));
        if let (Some(r), None) = (reasoning, think_end_id) {
            tracing::warn!(
                parser = ?r,
                "--reasoning-parser: no single think-end token, so requests that start in \
                 reasoning cannot also ask for a grammar (structured output or tool_choice \
                 required/named)"
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

/// Harmony is one format for both parsers: naming it for one and another format for the other
/// would read the same output two ways.
fn check_harmony_pair(
    reasoning: Option<ReasoningFormat>,
    tool_call: Option<ToolCallFormat>,
) -> Result<(), String> {
    let harmony_reasoning = reasoning == Some(ReasoningFormat::GptOss);
    let harmony_tools = tool_call == Some(ToolCallFormat::Harmony);
    match (reasoning, tool_call) {
        (Some(r), Some(t)) if harmony_reasoning != harmony_tools => Err(format!(
            "--reasoning-parser {r:?} and --tool-call-parser {t:?} disagree: GPT-OSS's harmony \
             format (gpt-oss) is one format for both, use it for both or for neither"
        )),
        _ => Ok(()),
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
    /// The model writes GPT-OSS's harmony (either parser flag named it): one parser reads the
    /// whole output, the request's tools or not.
    pub harmony: bool,
    /// SGLang's `separate_reasoning` (default true); false leaves the reasoning in the content.
    /// The grammar still starts after it (`starts_in_reasoning`): only the output changes.
    pub separate_reasoning: bool,
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
        self.split_reasoning().is_none() && self.tools == ToolMode::Off && !self.harmony
    }

    /// The reasoning format the output is split by (none when the request keeps it in the content).
    fn split_reasoning(&self) -> Option<ReasoningFormat> {
        self.reasoning.filter(|_| self.separate_reasoning)
    }

    /// Whether output begins inside the reasoning (a grammar then starts after it). Harmony's
    /// starts with its analysis channel whichever flag named the format.
    pub fn starts_in_reasoning(&self) -> bool {
        self.harmony
            || self
                .reasoning
                .is_some_and(|r| r.starts_in_reasoning(self.enable_thinking))
    }

    /// Whether harmony's calls are parsed, and whether only the first is kept.
    fn harmony_calls(&self) -> (bool, bool) {
        match self.tools {
            ToolMode::Parse {
                format: ToolCallFormat::Harmony,
                single,
            } => (true, single),
            _ => (false, false),
        }
    }

    /// Splits a whole answer.
    pub fn parse(&self, text: &str) -> ParsedMessage {
        let mut out = ParsedMessage::default();
        if self.harmony {
            let (calls, single) = self.harmony_calls();
            let m = harmony::parse(text, calls);
            if self.reasoning.is_some() {
                out.reasoning_content = m.reasoning_content;
            }
            out.content = m.content;
            out.tool_calls = m.tool_calls;
            if single {
                out.tool_calls.truncate(1);
            }
            return drop_blank_content(out);
        }
        let answer = match self.split_reasoning() {
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
        drop_blank_content(out)
    }

    /// The state for streaming one choice.
    pub fn stream(&self) -> OutputStream {
        let harmony = self.harmony;
        OutputStream {
            reasoning: self
                .split_reasoning()
                .filter(|_| !harmony)
                .map(|r| r.stream(self.enable_thinking)),
            tools: match &self.tools {
                _ if harmony => {
                    let (calls, single) = self.harmony_calls();
                    ToolState::Harmony {
                        stream: harmony::stream(calls),
                        single,
                        reasoning: self.reasoning.is_some(),
                    }
                }
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

/// Whitespace-only content is dropped when calls were made (the stream holds it back likewise).
fn drop_blank_content(mut out: ParsedMessage) -> ParsedMessage {
    if !out.tool_calls.is_empty() && out.content.trim().is_empty() {
        out.content.clear();
    }
    out
}

enum ToolState {
    Off,
    /// Harmony: reasoning, answer and calls from one parser; `reasoning`: report it.
    Harmony {
        stream: HarmonyStream,
        single: bool,
        reasoning: bool,
    },
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
        let (reasoning, d) = self.tool_stage(answer, last);
        out.reasoning_content.push_str(&reasoning);
        self.calls += d.tool_calls.iter().filter(|c| c.name.is_some()).count();
        out.tool_calls = d.tool_calls;
        out.content = self.content(d.content, last);
        out
    }

    /// The tool stage's share of one chunk of answer: harmony's reasoning, content and calls.
    fn tool_stage(&mut self, answer: String, last: bool) -> (String, ToolStreamDelta) {
        let (reasoning, mut d, single) = match &mut self.tools {
            ToolState::Off => {
                let d = ToolStreamDelta {
                    content: answer,
                    tool_calls: Vec::new(),
                };
                return (String::new(), d);
            }
            ToolState::Parse { stream, single } => {
                let mut d = stream.push(&answer);
                if last {
                    d = merge(d, stream.finish());
                }
                (String::new(), d, *single)
            }
            ToolState::Harmony {
                stream,
                single,
                reasoning,
            } => {
                let mut h = stream.push(&answer);
                if last {
                    let rest = stream.finish();
                    h.reasoning_content.push_str(&rest.reasoning_content);
                    h.content.push_str(&rest.content);
                    h.tool_calls = merge_calls(h.tool_calls, rest.tool_calls);
                }
                let d = ToolStreamDelta {
                    content: h.content,
                    tool_calls: h.tool_calls,
                };
                let kept = if *reasoning {
                    h.reasoning_content
                } else {
                    String::new()
                };
                (kept, d, *single)
            }
            ToolState::Named { name, sent } => {
                let mut call = ToolCallDelta {
                    index: 0,
                    name: None,
                    arguments: answer,
                };
                if (!call.arguments.is_empty() || last) && !*sent {
                    *sent = true;
                    call.name = Some(name.clone());
                }
                let d = ToolStreamDelta {
                    content: String::new(),
                    tool_calls: if call.name.is_some() || !call.arguments.is_empty() {
                        vec![call]
                    } else {
                        Vec::new()
                    },
                };
                return (String::new(), d);
            }
        };
        if single {
            d.tool_calls.retain(|c| c.index == 0);
        }
        (reasoning, d)
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
    a.tool_calls = merge_calls(a.tool_calls, b.tool_calls);
    a
}

fn merge_calls(mut a: Vec<ToolCallDelta>, b: Vec<ToolCallDelta>) -> Vec<ToolCallDelta> {
    for call in b {
        match a.iter_mut().find(|c| c.index == call.index) {
            Some(prev) => {
                if prev.name.is_none() {
                    prev.name = call.name;
                }
                prev.arguments.push_str(&call.arguments);
            }
            None => a.push(call),
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
mod tests;
