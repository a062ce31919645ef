//! NGRAM drafting (prompt lookup): the request's own prompt and output are searched for an
//! earlier occurrence of their last `n` tokens, and the tokens that followed it are proposed
//! as drafts. It needs no weights, and the scheduler holds every request's tokens, so it
//! lives here: the worker only verifies. Copy-heavy work (summarise, edit, quote code) gets
//! long accepted runs; elsewhere a miss costs nothing but the lookup.

/// Up to `k` draft tokens continuing `tokens`: the longest suffix of `min_n..=max_n` tokens
/// that occurred earlier, at its most recent earlier occurrence (recent text is the likeliest
/// to be copied next). Empty when no suffix recurs.
pub(super) fn propose(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 || min_n == 0 {
        return Vec::new();
    }
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Occurrences starting at j < len - n (not the suffix itself), latest first.
        let found = (0..len - n)
            .rev()
            .find(|&j| &tokens[j..j + n] == suffix && j + n < len);
        if let Some(j) = found {
            let from = j + n;
            return tokens[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::propose;

    #[test]
    fn proposes_what_followed_the_latest_match() {
        // "1 2 3 9 | 1 2 3 7 | 1 2 3" → the latest "1 2 3" was followed by 7, 1, 2, 3.
        let t = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3];
        assert_eq!(propose(&t, 1, 3, 4), vec![7, 1, 2, 3]);
        assert_eq!(propose(&t, 1, 3, 2), vec![7, 1]);
    }

    #[test]
    fn prefers_the_longest_suffix() {
        // Suffix "5 6" matched at 0 (→ 7); suffix "6" alone would match later at 4 (→ 8).
        let t = [5, 6, 7, 0, 6, 8, 5, 6];
        assert_eq!(propose(&t, 1, 2, 1), vec![7]);
        assert_eq!(propose(&t, 1, 1, 1), vec![8]);
    }

    #[test]
    fn nothing_without_a_match_or_room() {
        assert!(propose(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(propose(&[1], 1, 3, 4).is_empty());
        assert!(propose(&[1, 1], 2, 3, 4).is_empty());
        assert!(propose(&[1, 2, 1], 1, 3, 0).is_empty());
        // The match runs up to the end: drafts stop at the known tokens.
        assert_eq!(propose(&[4, 4], 1, 1, 3), vec![4]);
    }
}
