//! Reasoning parsers: split `<think>..</think>` reasoning from the answer, whole or streamed.
//!
//! - `deepseek-r1`: the output is reasoning until `</think>`; the opening `<think>` is optional
//!   (R1's chat template writes it into the prompt). No `</think>` at all: all reasoning.
//! - `qwen3`: the same while thinking is enabled (`chat_template_kwargs.enable_thinking`, default
//!   true; Qwen3-2507 templates also open the block in the prompt); with thinking disabled the
//!   template closes an empty block in the prompt, so the whole output is content.
//! - `deepseek-v3`: DeepSeek-V3.1's hybrid thinking, the same tags, but off unless the request
//!   sends `chat_template_kwargs.thinking: true` (its template's switch; then the template opens
//!   the block in the prompt). As SGLang's `deepseek-v3` does.
//! - `kimi`: Kimi's `◁think▷..◁/think▷`: reasoning only when the output opens with the block.
//! - `gpt-oss`: GPT-OSS's harmony channels (`crate::harmony`): the `analysis` channel is the
//!   reasoning, the rest the answer. Tool calls need the harmony tool parser too (the output
//!   stage then reads all of it with one `harmony` parser).
//!
//! As with tool calls, parsing is a snapshot of the text so far and streaming diffs snapshots,
//! so streamed pieces concatenate to the non-streamed result. Text is kept verbatim (the
//! newlines after `</think>` included); mapping empty strings to `null` is the API layer's.

use crate::tool_call::{diff_text, stable_len};

pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";
const KIMI_START: &str = "◁think▷";
const KIMI_END: &str = "◁/think▷";

/// `--reasoning-parser` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    DeepSeekR1,
    Qwen3,
    DeepSeekV3,
    Kimi,
    GptOss,
}

impl ReasoningFormat {
    pub const NAMES: [&'static str; 5] = ["deepseek-r1", "qwen3", "deepseek-v3", "kimi", "gpt-oss"];

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "deepseek-r1" | "deepseek_r1" => Some(ReasoningFormat::DeepSeekR1),
            "qwen3" | "qwen3-thinking" => Some(ReasoningFormat::Qwen3),
            "deepseek-v3" | "deepseek_v3" => Some(ReasoningFormat::DeepSeekV3),
            "kimi" => Some(ReasoningFormat::Kimi),
            // vLLM's name for it.
            "gpt-oss" | "gpt_oss" | "openai_gptoss" => Some(ReasoningFormat::GptOss),
            _ => None,
        }
    }

    /// The text whose appearance ends reasoning (the engine starts a grammar after it); None:
    /// no one marker does (harmony's answer starts after a header of several tokens, and
    /// analysis may follow it again).
    pub fn end_marker(self) -> Option<&'static str> {
        match self {
            ReasoningFormat::Kimi => Some(KIMI_END),
            ReasoningFormat::GptOss => None,
            _ => Some(THINK_END),
        }
    }

    /// The `chat_template_kwargs` key that switches thinking on and off in the model's template.
    pub fn thinking_kwarg(self) -> &'static str {
        match self {
            ReasoningFormat::DeepSeekV3 => "thinking",
            _ => "enable_thinking",
        }
    }

    /// Whether output starts in reasoning, given the request's thinking switch (`None`: not
    /// given, the template's default). Kimi's output does not: the model opens the block itself.
    pub fn starts_in_reasoning(self, enable_thinking: Option<bool>) -> bool {
        match self {
            ReasoningFormat::DeepSeekR1 | ReasoningFormat::GptOss => true,
            ReasoningFormat::Qwen3 => enable_thinking.unwrap_or(true),
            ReasoningFormat::DeepSeekV3 => enable_thinking.unwrap_or(false),
            ReasoningFormat::Kimi => false,
        }
    }

    /// Splits a whole output.
    pub fn parse(self, text: &str, enable_thinking: Option<bool>) -> ReasoningOutput {
        self.snapshot(text, self.starts_in_reasoning(enable_thinking), true)
    }

    fn snapshot(self, text: &str, thinking: bool, finished: bool) -> ReasoningOutput {
        match self {
            ReasoningFormat::GptOss => {
                let snap = crate::harmony::snapshot(text, false, finished);
                ReasoningOutput {
                    reasoning_content: snap.reasoning,
                    content: snap.content,
                }
            }
            ReasoningFormat::Kimi => snapshot(text, Block::OPTIONAL_KIMI, finished),
            _ if thinking => snapshot(text, Block::THINK, finished),
            _ => ReasoningOutput {
                reasoning_content: String::new(),
                content: text.to_string(),
            },
        }
    }

    /// A parser for one streamed response.
    pub fn stream(self, enable_thinking: Option<bool>) -> ReasoningStream {
        ReasoningStream {
            format: self,
            thinking: self.starts_in_reasoning(enable_thinking),
            text: String::new(),
            sent: ReasoningOutput::default(),
        }
    }
}

/// Reasoning and answer, whole or as one streamed delta.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReasoningOutput {
    pub reasoning_content: String,
    pub content: String,
}

impl ReasoningOutput {
    pub fn is_empty(&self) -> bool {
        self.reasoning_content.is_empty() && self.content.is_empty()
    }
}

/// A reasoning block's tags, and whether the output must open it (else it starts inside).
struct Block {
    start: &'static str,
    end: &'static str,
    opened: bool,
}

impl Block {
    const THINK: Block = Block {
        start: THINK_START,
        end: THINK_END,
        opened: false,
    };
    const OPTIONAL_KIMI: Block = Block {
        start: KIMI_START,
        end: KIMI_END,
        opened: true,
    };

    /// Whether `text` (unfinished) could still turn out to open the block.
    fn may_open(&self, text: &str) -> bool {
        self.start.starts_with(text) || text.starts_with(self.start)
    }
}

/// What `text` says for sure, the output starting in (or at) `block`; `finished` releases
/// held-back partial tags.
fn snapshot(text: &str, block: Block, finished: bool) -> ReasoningOutput {
    let mut out = ReasoningOutput::default();
    let body = match text.strip_prefix(block.start) {
        Some(rest) => rest,
        // Hold a partial opening tag back: it is not reasoning text.
        None if !finished && block.start.starts_with(text) => return out,
        None if block.opened => {
            out.content = text.to_string();
            return out;
        }
        None => text,
    };
    match body.find(block.end) {
        Some(end) => {
            out.reasoning_content = body[..end].to_string();
            out.content = body[end + block.end.len()..].to_string();
        }
        None => {
            let keep = if finished {
                body.len()
            } else {
                stable_len(body, &[block.end])
            };
            out.reasoning_content = body[..keep].to_string();
        }
    }
    out
}

/// Streaming state: the text so far and what was sent of it.
pub struct ReasoningStream {
    format: ReasoningFormat,
    thinking: bool,
    text: String,
    sent: ReasoningOutput,
}

impl ReasoningStream {
    /// Whether the reasoning has ended (everything from now on is the answer). Never for
    /// harmony: another analysis message may follow the answer's.
    pub fn reasoning_ended(&self) -> bool {
        match self.format {
            ReasoningFormat::GptOss => false,
            ReasoningFormat::Kimi => {
                let block = Block::OPTIONAL_KIMI;
                !block.may_open(&self.text) || self.text.contains(block.end)
            }
            _ => !self.thinking || self.text.contains(THINK_END),
        }
    }

    pub fn push(&mut self, delta: &str) -> ReasoningOutput {
        self.text.push_str(delta);
        let snap = self.format.snapshot(&self.text, self.thinking, false);
        self.diff(snap)
    }

    pub fn finish(&mut self) -> ReasoningOutput {
        let snap = self.format.snapshot(&self.text, self.thinking, true);
        self.diff(snap)
    }

    fn diff(&mut self, snap: ReasoningOutput) -> ReasoningOutput {
        ReasoningOutput {
            reasoning_content: diff_text(&mut self.sent.reasoning_content, snap.reasoning_content),
            content: diff_text(&mut self.sent.content, snap.content),
        }
    }
}
