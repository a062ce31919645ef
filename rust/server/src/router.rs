//! Which data-parallel replica serves a request (`--load-balance-method`): pure policy over
//! numbers the caller gathers (outstanding requests per replica, and for `cache_aware` each
//! replica's exact cached prefix length for the prompt). No clocks, threads or engines here.

use std::str::FromStr;

/// `cache_aware` routes to the replica holding the longest cached prefix only when that prefix
/// covers at least this share of the prompt. SGLang's router uses the same rule with
/// `--cache-threshold 0.5` by default: below half, the prefill saved is smaller than the work
/// left, and chasing a short match (a chat template's first page, say) would pile unrelated
/// requests onto one replica; above it, the saved prefill dominates the request's cost.
pub const CACHE_THRESHOLD: f64 = 0.5;
/// ... unless that replica is this many requests busier than the least loaded one *and*
/// `BALANCE_REL` times as busy (SGLang's router skips the cache when the replicas are out of
/// balance by both an absolute and a relative margin, with thresholds of the same order): a hot
/// prefix may concentrate load, but never starve the other replicas while one queues deep.
pub const BALANCE_ABS: usize = 32;
pub const BALANCE_REL: f64 = 1.5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Replica 0, 1, ..., N-1, 0, ...: SGLang's default for `--dp-size`.
    RoundRobin,
    /// Fewest outstanding (running + queued) requests.
    ShortestQueue,
    /// Longest exact cached prefix when it is a meaningful share of the prompt, otherwise the
    /// least loaded.
    CacheAware,
}

impl FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "round_robin" => Ok(Policy::RoundRobin),
            "shortest_queue" => Ok(Policy::ShortestQueue),
            "cache_aware" => Ok(Policy::CacheAware),
            other => Err(format!(
                "--load-balance-method {other:?} is not supported (round_robin, shortest_queue, \
                 cache_aware)"
            )),
        }
    }
}

/// The router's own state: a cursor that rotates round robin and breaks ties between equally
/// loaded replicas (without it, sequential requests on an idle server would all land on
/// replica 0 under `shortest_queue`).
#[derive(Debug, Clone)]
pub struct Router {
    policy: Policy,
    replicas: usize,
    cursor: usize,
}

impl Router {
    pub fn new(policy: Policy, replicas: usize) -> Self {
        Router {
            policy,
            replicas: replicas.max(1),
            cursor: 0,
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Whether `pick` wants each replica's cached prefix length for the prompt.
    pub fn wants_prefix_lengths(&self) -> bool {
        self.policy == Policy::CacheAware && self.replicas > 1
    }

    /// The replica for a request. `outstanding[r]`: requests replica r has not finished;
    /// `prefix`: for `cache_aware`, each replica's cached prefix length (tokens) of the prompt
    /// and the prompt's length; None (a replica did not answer, or another policy) falls back
    /// to the least loaded.
    pub fn pick(&mut self, outstanding: &[usize], prefix: Option<(&[usize], usize)>) -> usize {
        let n = self.replicas.min(outstanding.len()).max(1);
        let start = self.cursor % n;
        self.cursor = (start + 1) % n;
        match self.policy {
            _ if n == 1 => 0,
            Policy::RoundRobin => start,
            Policy::ShortestQueue => least_loaded(&outstanding[..n], start),
            Policy::CacheAware => match prefix {
                Some((matched, prompt_len)) if matched.len() >= n => {
                    cache_aware(&outstanding[..n], &matched[..n], prompt_len, start)
                }
                _ => least_loaded(&outstanding[..n], start),
            },
        }
    }
}

/// The replica with the fewest outstanding requests; ties go to the first at or after `start`.
pub fn least_loaded(outstanding: &[usize], start: usize) -> usize {
    let n = outstanding.len();
    (0..n)
        .map(|k| (start + k) % n)
        .min_by_key(|&r| outstanding[r])
        .unwrap_or(0)
}

/// The replica holding the longest cached prefix of the prompt if it covers `CACHE_THRESHOLD`
/// of it and that replica is not overloaded (see `BALANCE_ABS`), else the least loaded.
/// Ties on the match length go to the less loaded replica.
pub fn cache_aware(
    outstanding: &[usize],
    matched: &[usize],
    prompt_len: usize,
    start: usize,
) -> usize {
    let lightest = least_loaded(outstanding, start);
    let n = outstanding.len();
    let Some(best) = (0..n)
        .map(|k| (start + k) % n)
        .max_by_key(|&r| (matched[r], std::cmp::Reverse(outstanding[r])))
    else {
        return lightest;
    };
    let meaningful = prompt_len > 0
        && matched[best] > 0
        && matched[best] as f64 >= CACHE_THRESHOLD * prompt_len as f64;
    let (busy, idle) = (outstanding[best], outstanding[lightest]);
    let overloaded = busy > idle + BALANCE_ABS && busy as f64 > BALANCE_REL * idle as f64;
    if meaningful && !overloaded {
        best
    } else {
        lightest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_cycles_through_replicas_whatever_their_load() {
        let mut r = Router::new(Policy::RoundRobin, 3);
        let picks: Vec<_> = (0..7).map(|_| r.pick(&[100, 0, 0], None)).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2, 0]);
    }

    #[test]
    fn one_replica_always_gets_everything() {
        for policy in [
            Policy::RoundRobin,
            Policy::ShortestQueue,
            Policy::CacheAware,
        ] {
            let mut r = Router::new(policy, 1);
            assert!(!r.wants_prefix_lengths());
            assert_eq!(r.pick(&[5], Some((&[0], 10))), 0);
        }
    }

    #[test]
    fn shortest_queue_picks_the_fewest_outstanding() {
        let mut r = Router::new(Policy::ShortestQueue, 3);
        assert_eq!(r.pick(&[4, 1, 3], None), 1);
        assert_eq!(r.pick(&[0, 9, 9], None), 0);
        assert_eq!(r.pick(&[7, 7, 2], None), 2);
    }

    #[test]
    fn shortest_queue_spreads_ties_instead_of_always_taking_replica_0() {
        let mut r = Router::new(Policy::ShortestQueue, 2);
        let picks: Vec<_> = (0..4).map(|_| r.pick(&[0, 0], None)).collect();
        assert_eq!(picks, vec![0, 1, 0, 1]);
    }

    #[test]
    fn shortest_queue_balances_a_burst() {
        // Each pick adds one outstanding request to the chosen replica.
        let mut r = Router::new(Policy::ShortestQueue, 2);
        let mut load = [5, 0];
        for _ in 0..15 {
            let i = r.pick(&load, None);
            load[i] += 1;
        }
        assert_eq!(load, [10, 10]);
    }

    #[test]
    fn cache_aware_follows_a_long_cached_prefix() {
        let mut r = Router::new(Policy::CacheAware, 2);
        assert!(r.wants_prefix_lengths());
        // Replica 1 holds 96 of the prompt's 100 tokens, though it is busier.
        assert_eq!(r.pick(&[0, 3], Some((&[0, 96], 100))), 1);
        assert_eq!(r.pick(&[0, 3], Some((&[0, 96], 100))), 1);
    }

    #[test]
    fn cache_aware_ignores_a_match_below_the_threshold() {
        let mut r = Router::new(Policy::CacheAware, 2);
        // 48 of 100 tokens: under CACHE_THRESHOLD, so the least loaded replica.
        assert_eq!(r.pick(&[0, 3], Some((&[0, 48], 100))), 0);
        // Exactly half counts as meaningful.
        assert_eq!(r.pick(&[0, 3], Some((&[0, 50], 100))), 1);
    }

    #[test]
    fn cache_aware_without_any_match_spreads_by_load_and_ties() {
        let mut r = Router::new(Policy::CacheAware, 2);
        assert_eq!(r.pick(&[2, 1], Some((&[0, 0], 40))), 1);
        let mut r = Router::new(Policy::CacheAware, 2);
        let picks: Vec<_> = (0..4)
            .map(|_| r.pick(&[0, 0], Some((&[0, 0], 40))))
            .collect();
        assert_eq!(picks, vec![0, 1, 0, 1]);
    }

    #[test]
    fn cache_aware_falls_back_when_lengths_are_missing() {
        let mut r = Router::new(Policy::CacheAware, 2);
        assert_eq!(r.pick(&[3, 1], None), 1);
    }

    #[test]
    fn cache_aware_prefers_the_longer_match_then_the_lighter_replica() {
        assert_eq!(cache_aware(&[0, 0, 0], &[64, 80, 16], 100, 0), 1);
        // Equal matches: the less loaded of the two.
        assert_eq!(cache_aware(&[5, 2, 0], &[80, 80, 0], 100, 0), 1);
    }

    #[test]
    fn cache_aware_does_not_pile_onto_an_overloaded_replica() {
        // Busier by more than BALANCE_ABS and more than BALANCE_REL times: the cache loses.
        let busy = BALANCE_ABS + 11;
        assert_eq!(cache_aware(&[busy, 10], &[90, 0], 100, 0), 1);
        // Over the absolute margin but within the relative one: the cache still wins.
        let (b, a) = (BALANCE_ABS * 5, BALANCE_ABS * 5 + BALANCE_ABS + 8);
        assert_eq!(cache_aware(&[a, b], &[90, 0], 100, 0), 0);
    }

    #[test]
    fn policies_parse_by_their_flag_names() {
        assert_eq!("round_robin".parse(), Ok(Policy::RoundRobin));
        assert_eq!("shortest_queue".parse(), Ok(Policy::ShortestQueue));
        assert_eq!("cache_aware".parse(), Ok(Policy::CacheAware));
        let err = "minimum_tokens".parse::<Policy>().unwrap_err();
        assert!(err.contains("minimum_tokens"), "{err}");
    }
}
