//! Reading server-sent events off a byte stream (the harness's HTTP clients, the desktop shell).

/// Takes every complete server-sent event out of `buffer` and returns their `data` payloads;
/// a partial event stays for the next read.
pub fn complete_sse_data(buffer: &mut Vec<u8>) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
        let event: Vec<u8> = buffer.drain(..end + 2).collect();
        out.extend(String::from_utf8_lossy(&event).lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string));
    }
    out
}

