//! The HTTP floor: a trivial axum server in this process, on its own runtime.

use super::*;

pub(crate) const FIXED_REPLY: &str = r#"{"worker":"w007","decision":"owner_hold","matched_blocks":256,"prompt_blocks":256,"owners":["w007"],"reservation":123456,"request_id":null}"#;

#[derive(Deserialize)]
pub(crate) struct ParseOnly {
    #[allow(dead_code)]
    pub(crate) tokens: Option<Vec<u32>>,
    #[allow(dead_code)]
    pub(crate) block_keys: Option<Vec<u64>>,
    #[allow(dead_code)]
    pub(crate) max_output_tokens: Option<u64>,
}

pub(crate) async fn floor(body: AxumBytes) -> impl IntoResponse {
    std::hint::black_box(body.len());
    ([(header::CONTENT_TYPE, "application/json")], FIXED_REPLY)
}

pub(crate) async fn floor_parse(body: AxumBytes) -> impl IntoResponse {
    let parsed: ParseOnly = serde_json::from_slice(&body).expect("a route body");
    std::hint::black_box(&parsed);
    ([(header::CONTENT_TYPE, "application/json")], FIXED_REPLY)
}

/// Starts the floor server (2 worker threads, like the daemon on this machine); returns its
/// address. It lives until the process exits.
pub(crate) fn start_floor() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let app = axum::Router::new()
                .route("/floor", post(floor))
                .route("/floor_parse", post(floor_parse))
                .layer(axum::extract::DefaultBodyLimit::max(8 << 20));
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    addr
}
