//! Stop-string (and stop-regex) matching over streamed text: holds back ("jails") any tail that
//! could begin a stop string or a regex match.

use crate::stop_regex::StopRegex;

/// The result of feeding one chunk of text to a [`StopMatcher`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopStep {
    /// Text that is safe to send to the client now.
    pub emit: String,
    /// True once a stop string has completed; `emit` then ends right before it.
    pub stopped: bool,
    /// The stop string (or the stop regex's pattern) that matched (reported to clients as
    /// `matched_stop`).
    pub matched: Option<String>,
    /// The text the match covered (the stop string itself, or what the regex matched).
    pub matched_text: String,
}

/// Per-request stop-string matcher.
///
/// Invariant: `held` is the longest suffix of the text seen so far that is a proper prefix of some
/// stop string. Everything before it can never be part of a stop string, so it is emitted; a partial
/// stop string is therefore never sent to the client.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    regexes: Vec<StopRegex>,
    max_stop_len: usize,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stop_strings: Vec<String>) -> Self {
        let stops: Vec<String> = stop_strings.into_iter().filter(|s| !s.is_empty()).collect();
        let max_stop_len = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            regexes: Vec::new(),
            max_stop_len,
            held: String::new(),
            stopped: false,
        }
    }

    /// Also stops at the first match of any of `regexes`.
    pub fn with_regexes(mut self, regexes: Vec<StopRegex>) -> Self {
        self.regexes = regexes;
        self
    }

    /// Whether a stop string has already been matched.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds newly decoded text; returns what may be emitted and whether generation should stop.
    pub fn push(&mut self, text: &str) -> StopStep {
        if self.stopped {
            return StopStep {
                stopped: true,
                ..StopStep::default()
            };
        }
        if self.stops.is_empty() && self.regexes.is_empty() {
            return StopStep {
                emit: text.to_owned(),
                ..StopStep::default()
            };
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(text);

        // Any stop string must start inside `buf` (see the invariant). The match that completes
        // first wins (ties: the one that starts first), as if the text arrived byte by byte: the
        // result then does not depend on how the text was split into tokens, and generation never
        // has to run past a completed stop string to learn whether an earlier one completes too.
        // A regex match counts from where it ends too.
        let strings = self.stops.iter().filter_map(|s| {
            buf.find(s.as_str())
                .map(|pos| (pos, pos + s.len(), s.as_str()))
        });
        let regexes = self
            .regexes
            .iter()
            .filter_map(|r| r.find(&buf).map(|(start, end)| (start, end, r.pattern())));
        let earliest = strings
            .chain(regexes)
            .min_by_key(|&(start, end, _)| (end, start));
        if let Some((start, end, stop)) = earliest {
            let matched = Some(stop.to_owned());
            let matched_text = buf[start..end].to_owned();
            buf.truncate(start);
            self.stopped = true;
            return StopStep {
                emit: buf,
                stopped: true,
                matched,
                matched_text,
            };
        }

        let partial = self.longest_partial_suffix(&buf);
        let hold_from = self
            .regexes
            .iter_mut()
            .map(|r| r.hold_from(&buf))
            .fold(partial, usize::min);
        self.held = buf.split_off(hold_from);
        StopStep {
            emit: buf,
            ..StopStep::default()
        }
    }

    /// Releases the held-back text at the end of generation (nothing if a stop string matched).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Byte index where the longest suffix of `buf` that is a proper prefix of a stop string
    /// begins, or `buf.len()` when there is none.
    fn longest_partial_suffix(&self, buf: &str) -> usize {
        if self.stops.is_empty() {
            return buf.len();
        }
        // A partial match is shorter than the longest stop string, so only the tail is scanned.
        let window_start = buf
            .len()
            .saturating_sub(self.max_stop_len.saturating_sub(1));
        buf.char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= window_start)
            .find(|&i| {
                let tail = &buf[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(buf.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], chunks: &[&str]) -> (String, bool, String) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for c in chunks {
            let step = m.push(c);
            out.push_str(&step.emit);
            if step.stopped {
                return (out, true, m.finish());
            }
        }
        (out, false, m.finish())
    }

    #[test]
    fn text_without_stop_strings_passes_through() {
        assert_eq!(
            run(&[], &["hello", " world"]),
            ("hello world".into(), false, String::new())
        );
    }

    #[test]
    fn stop_string_in_one_chunk_cuts_before_it() {
        assert_eq!(
            run(&["STOP"], &["abcSTOPdef"]),
            ("abc".into(), true, String::new())
        );
    }

    #[test]
    fn stop_string_split_across_many_chunks_is_matched() {
        assert_eq!(
            run(&["<|end|>"], &["hi <", "|", "en", "d", "|> tail"]),
            ("hi ".into(), true, String::new())
        );
    }

    #[test]
    fn partial_stop_string_is_held_back_not_emitted() {
        let mut m = StopMatcher::new(vec!["###".into()]);
        assert_eq!(m.push("a#").emit, "a");
        assert_eq!(m.push("#").emit, "");
        let step = m.push("b");
        assert_eq!(step.emit, "##b");
        assert!(!step.stopped);
    }

    #[test]
    fn held_text_is_released_by_finish() {
        assert_eq!(
            run(&["STOP"], &["abc", "ST"]),
            ("abc".into(), false, "ST".into())
        );
    }

    #[test]
    fn overlapping_candidates_pick_the_earliest_match() {
        // "abcd" is still possible when "bc" completes: the earliest complete match wins.
        assert_eq!(run(&["abcd", "bc"], &["xa", "b", "c"]).0, "xa");
        // A longer candidate that fails does not swallow a later, shorter one.
        assert_eq!(run(&["abcd", "bcx"], &["a", "bc", "x"]).0, "a");
    }

    #[test]
    fn the_stop_string_that_completes_first_wins_however_the_text_is_split() {
        // "中a中" starts earlier but "a" completes first, in one chunk or in three.
        assert_eq!(run(&["a", "中a中"], &["x中a中y"]).0, "x中");
        assert_eq!(run(&["a", "中a中"], &["x中", "a", "中y"]).0, "x中");
        // Same end: the longer (earlier-starting) match is cut.
        assert_eq!(run(&["bc", "abc"], &["xabcy"]).0, "x");
    }

    #[test]
    fn self_overlapping_stop_string_is_found_after_false_start() {
        assert_eq!(run(&["aab"], &["a", "a", "a", "b"]).0, "a");
    }

    #[test]
    fn multibyte_stop_strings_hold_on_char_boundaries() {
        let mut m = StopMatcher::new(vec!["停止".into()]);
        assert_eq!(m.push("你好停").emit, "你好");
        let step = m.push("止了");
        assert_eq!(step.emit, "");
        assert!(step.stopped);
    }

    #[test]
    fn after_stopping_everything_is_dropped() {
        let mut m = StopMatcher::new(vec!["x".into()]);
        let first = m.push("ax");
        assert!(first.stopped);
        assert_eq!(first.matched.as_deref(), Some("x"));
        assert_eq!(
            m.push("more"),
            StopStep {
                stopped: true,
                ..StopStep::default()
            }
        );
        assert!(m.is_stopped());
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn a_stop_regex_cuts_before_its_match_however_the_text_is_split() {
        let regex = || vec![StopRegex::new(r"\d+\.").expect("valid")];
        for chunks in [
            &["It is 42. Done"][..],
            &["It is 4", "2", ". Done"],
            &["It is ", "42", "."],
        ] {
            let mut m = StopMatcher::new(Vec::new()).with_regexes(regex());
            let mut out = String::new();
            let mut last = StopStep::default();
            for c in chunks {
                last = m.push(c);
                out.push_str(&last.emit);
                if last.stopped {
                    break;
                }
            }
            assert_eq!(out, "It is ", "{chunks:?}");
            assert!(last.stopped);
            assert_eq!(last.matched.as_deref(), Some(r"\d+\."));
            assert_eq!(last.matched_text, "42.");
        }
        // A digit run not followed by "." is released.
        let mut m = StopMatcher::new(Vec::new()).with_regexes(regex());
        assert_eq!(m.push("4").emit, "");
        assert_eq!(m.push("2 x").emit, "42 x");
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        assert_eq!(run(&[""], &["abc"]).0, "abc");
    }
}
