//! Stop regexes (SGLang's `stop_regex`): a request ends when its output matches one. Like a
//! stop string, the text from where a match could still start is held back, so the output is
//! cut right before the match however it streams. `regex` finds complete matches; the lazy DFA
//! of `regex-automata` (the engine under `regex`) tells whether a match could still start at a
//! position, given the text after it so far.

use regex_automata::hybrid::dfa::{Cache, DFA};
use regex_automata::util::start;
use regex_automata::Anchored;

/// One stop regex, compiled.
#[derive(Debug, Clone)]
pub struct StopRegex {
    pattern: String,
    re: regex::Regex,
    dfa: DFA,
    cache: Cache,
}

impl StopRegex {
    /// Refuses a pattern that does not compile, or that matches the empty string (it would
    /// stop every request before its first character).
    pub fn new(pattern: &str) -> Result<Self, String> {
        let re = regex::Regex::new(pattern).map_err(|e| e.to_string())?;
        if re.is_match("") {
            return Err(format!("{pattern:?} matches the empty string"));
        }
        let dfa = DFA::new(pattern).map_err(|e| e.to_string())?;
        let cache = dfa.create_cache();
        Ok(Self {
            pattern: pattern.to_owned(),
            re,
            dfa,
            cache,
        })
    }

    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// The first complete match in `text`: (start, end).
    pub fn find(&self, text: &str) -> Option<(usize, usize)> {
        self.re.find(text).map(|m| (m.start(), m.end()))
    }

    /// Whether some continuation of `tail` could match from its start.
    fn could_match(&mut self, tail: &str) -> bool {
        let config = start::Config::new().anchored(Anchored::Yes);
        let Ok(mut sid) = self.dfa.start_state(&mut self.cache, &config) else {
            return true; // the DFA gave up: hold, as if it could
        };
        for &b in tail.as_bytes() {
            match self.dfa.next_state(&mut self.cache, sid, b) {
                Ok(next) if next.is_dead() => return false,
                Ok(next) if next.is_quit() => return true,
                Ok(next) => sid = next,
                Err(_) => return true,
            }
        }
        true
    }

    /// Byte index (on a char boundary) where the earliest possible match in `text` starts, or
    /// `text.len()` when none can.
    pub fn hold_from(&mut self, text: &str) -> usize {
        text.char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.could_match(&text[i..]))
            .unwrap_or(text.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_from_where_a_match_could_start() {
        let mut r = StopRegex::new(r"Answer: \d+").expect("valid");
        assert_eq!(r.hold_from("so the Ans"), 7);
        assert_eq!(r.hold_from("so the Answer: "), 7);
        assert_eq!(r.hold_from("so the Answer: x"), 16);
        assert_eq!(r.find("so the Answer: 42."), Some((7, 17)));
        assert!(StopRegex::new("a*").is_err());
        assert!(StopRegex::new("(").is_err());
    }
}
