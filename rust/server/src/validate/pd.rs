//! SGLang's prefill/decode fields: `bootstrap_room` (the KV transfer a request joins) and
//! `bootstrap_host` / `bootstrap_port` (where its router says the pair meets: the prefill
//! server's bootstrap service). A server's pair is fixed at start, so the host and port are
//! checked against it, never followed: a request that names another pair is refused.

use tokenspeed_engine::KvTransfer;

use crate::error::RequestError;

/// The PD fields of one request, as given.
#[derive(Debug, Clone, Copy, Default)]
pub struct PdFields<'a> {
    pub room: Option<u64>,
    pub host: Option<&'a str>,
    pub port: Option<u32>,
}

/// This server's side of its pair (`ServerConfig::pd_pair`).
#[derive(Debug, Clone, Copy)]
pub struct PdPair<'a> {
    /// `--disaggregation-mode`: "null", "prefill" or "decode".
    pub mode: &'a str,
    /// `--disaggregation-bootstrap-host` and `-port`: where the pair meets.
    pub host: &'a str,
    pub port: u32,
}

/// The KV transfer a request joins on a prefill or decode server (`--disaggregation-mode`),
/// one generation per request; its host and port must be this server's pair's. Refused on a
/// combined server, where no transfer could happen.
pub fn bootstrap(
    given: PdFields<'_>,
    pair: PdPair<'_>,
    choices: usize,
) -> Result<KvTransfer, RequestError> {
    let mode = pair.mode;
    let named = given.room.is_some() || given.host.is_some() || given.port.is_some();
    if named && mode != "prefill" && mode != "decode" {
        let field = match given.room {
            Some(_) => "bootstrap_room",
            None if given.host.is_some() => "bootstrap_host",
            None => "bootstrap_port",
        };
        return refuse(
            field,
            format!(
                "'{field}' names a prefill/decode KV transfer: this server runs neither \
                 (start it with --disaggregation-mode prefill or decode)"
            ),
        );
    }
    if let Some(port) = given.port.filter(|&p| p != pair.port) {
        return refuse(
            "bootstrap_port",
            format!(
                "'bootstrap_port' {port} is not this {mode} server's pair, which meets at port \
                 {} (--disaggregation-bootstrap-port)",
                pair.port
            ),
        );
    }
    // The prefill server hosts the bootstrap service: the host is the router's name for it.
    let pair_host = pair.host;
    if let Some(host) = given
        .host
        .filter(|h| mode == "decode" && !same_host(h, pair_host))
    {
        return refuse(
            "bootstrap_host",
            format!(
                "'bootstrap_host' {host:?} is not this decode server's prefill peer \
                 {pair_host:?} (--disaggregation-bootstrap-host; spell the router's prefill URL \
                 with the same host)"
            ),
        );
    }
    let Some(room) = given.room else {
        return Ok(KvTransfer::None);
    };
    if choices != 1 {
        return refuse(
            "bootstrap_room",
            "a request with 'bootstrap_room' generates one choice (n = 1)".into(),
        );
    }
    Ok(match mode {
        "prefill" => KvTransfer::Send { room },
        _ => KvTransfer::Recv { room },
    })
}

fn refuse(field: &str, why: String) -> Result<KvTransfer, RequestError> {
    Err(RequestError::bad_param(field, why))
}

/// Whether two spellings of a host name the same one: equal (case aside), the same IP
/// address, or both this machine's loopback. No name is resolved (a request is not the place
/// for a DNS lookup).
fn same_host(a: &str, b: &str) -> bool {
    let ip = |h: &str| h.trim_matches(['[', ']']).parse::<std::net::IpAddr>().ok();
    let loopback =
        |h: &str| h.eq_ignore_ascii_case("localhost") || ip(h).is_some_and(|i| i.is_loopback());
    a.eq_ignore_ascii_case(b) || (ip(a).is_some() && ip(a) == ip(b)) || (loopback(a) && loopback(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(mode: &str) -> PdPair<'_> {
        PdPair {
            mode,
            host: "10.0.0.7",
            port: 8998,
        }
    }

    fn field_of(r: Result<KvTransfer, RequestError>) -> String {
        match r {
            Err(e) => format!("{e:?}"),
            Ok(kv) => format!("accepted {kv:?}"),
        }
    }

    #[test]
    fn sglangs_fields_at_this_pairs_values_are_accepted() {
        let given = PdFields {
            room: Some(5),
            host: Some("10.0.0.7"),
            port: Some(8998),
        };
        let got = bootstrap(given, server("decode"), 1).ok();
        assert_eq!(got, Some(KvTransfer::Recv { room: 5 }));
        let prefill = PdFields {
            host: Some("prefill-0.example"),
            ..given
        };
        let got = bootstrap(prefill, server("prefill"), 1).ok();
        assert_eq!(got, Some(KvTransfer::Send { room: 5 }));
        let none = bootstrap(PdFields::default(), server("null"), 4).ok();
        assert_eq!(none, Some(KvTransfer::None));
        assert!(same_host("LOCALHOST", "127.0.0.1") && same_host("[::1]", "localhost"));
    }

    #[test]
    fn fields_naming_another_pair_are_refused_by_name() {
        let other_port = PdFields {
            room: Some(5),
            host: Some("10.0.0.7"),
            port: Some(9000),
        };
        let e = field_of(bootstrap(other_port, server("decode"), 1));
        assert!(e.contains("bootstrap_port") && e.contains("9000"), "{e}");
        let other_host = PdFields {
            host: Some("10.0.0.8"),
            port: None,
            ..other_port
        };
        let e = field_of(bootstrap(other_host, server("decode"), 1));
        assert!(
            e.contains("bootstrap_host") && e.contains("10.0.0.8"),
            "{e}"
        );
        let combined = PdFields {
            room: None,
            ..other_host
        };
        let e = field_of(bootstrap(combined, server("null"), 1));
        assert!(e.contains("bootstrap_host"), "{e}");
        let two = PdFields {
            room: Some(1),
            ..Default::default()
        };
        let e = field_of(bootstrap(two, server("prefill"), 2));
        assert!(e.contains("bootstrap_room"), "{e}");
    }
}
