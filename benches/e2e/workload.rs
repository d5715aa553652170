//! The workload.

use super::*;

pub(crate) fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Token `t` of conversation prefix `j`: a vocabulary of 128k ids.
pub(crate) fn token(j: usize, t: usize) -> u32 {
    (mix(((j as u64) << 32) | t as u64) % 128_000) as u32
}

/// The engine's hash of block `b` of prefix `j` (the same on every worker, as vLLM's are).
pub(crate) fn engine_hash(j: usize, b: usize) -> u64 {
    mix(((j as u64) << 32) | b as u64 | (1 << 63)) >> 1
}

/// Pre-encoded events: `stored[j][i]` stores batch `i` of prefix `j`, `removed[j][i]` removes it.
pub(crate) struct Payloads {
    pub(crate) stored: Vec<Vec<Vec<u8>>>,
    pub(crate) removed: Vec<Vec<Vec<u8>>>,
}

/// The msgpack of one event, cut out of a one-event vLLM batch `[ts, [event], nil]`.
pub(crate) fn event_bytes(event: VllmEvent) -> Vec<u8> {
    let batch = encode_vllm_batch(1.0, &[event], None);
    assert_eq!(
        (batch[0], batch[1], batch[10], *batch.last().unwrap()),
        (0x93, 0xcb, 0x91, 0xc0),
        "vLLM batch layout"
    );
    batch[11..batch.len() - 1].to_vec()
}

/// `[ts, [events...], nil]`, byte for byte what `encode_vllm_batch` writes.
pub(crate) fn batch_bytes(events: &[&[u8]]) -> Bytes {
    let len: usize = events.iter().map(|e| e.len()).sum();
    let mut out = Vec::with_capacity(12 + len);
    out.push(0x93);
    out.push(0xcb);
    out.extend_from_slice(&1.0f64.to_be_bytes());
    out.push(0x90 | events.len() as u8);
    for e in events {
        out.extend_from_slice(e);
    }
    out.push(0xc0);
    Bytes::from(out)
}

pub(crate) fn build_payloads() -> Payloads {
    let mut p = Payloads {
        stored: Vec::new(),
        removed: Vec::new(),
    };
    for j in 0..PREFIXES {
        let (mut stored, mut removed) = (Vec::new(), Vec::new());
        for i in 0..BATCHES_PER_PREFIX {
            let blocks = i * BATCH_BLOCKS..(i + 1) * BATCH_BLOCKS;
            let hashes: Vec<u64> = blocks.clone().map(|b| engine_hash(j, b)).collect();
            stored.push(event_bytes(VllmEvent::BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: (i > 0).then(|| engine_hash(j, blocks.start - 1)),
                token_ids: (blocks.start * BLOCK..blocks.end * BLOCK)
                    .map(|t| token(j, t))
                    .collect(),
                block_size: BLOCK as u32,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
            }));
            removed.push(event_bytes(VllmEvent::BlockRemoved {
                block_hashes: hashes.into_iter().rev().collect(),
                medium: Some("GPU".into()),
            }));
        }
        p.stored.push(stored);
        p.removed.push(removed);
    }
    p
}

/// A simulated worker's position in its stream of prefixes.
pub(crate) struct SimWorker {
    pub(crate) subject: String,
    pub(crate) w: usize,
    pub(crate) seq: u64,
    /// Prefixes started so far, and the next batch of the current one.
    pub(crate) k: usize,
    pub(crate) i: usize,
    /// Whether the removal that goes before batch `i` has been sent.
    pub(crate) evicted: bool,
}

impl SimWorker {
    pub(crate) fn prefix(&self, k: usize) -> usize {
        (self.w * 5 + k) % PREFIXES
    }

    /// The next message, one 32-block event each: (payload, stored blocks, removed blocks).
    pub(crate) fn next(&mut self, p: &Payloads) -> (Bytes, u64, u64) {
        self.seq += 1;
        if self.k >= HELD_PREFIXES && !self.evicted {
            // Evict the oldest prefix tail first: 32 blocks before each 32 stored.
            self.evicted = true;
            let old = self.prefix(self.k - HELD_PREFIXES);
            let removed = &p.removed[old][BATCHES_PER_PREFIX - 1 - self.i];
            return (batch_bytes(&[removed]), 0, BATCH_BLOCKS as u64);
        }
        self.evicted = false;
        let stored = &p.stored[self.prefix(self.k)][self.i];
        self.i += 1;
        if self.i == BATCHES_PER_PREFIX {
            self.i = 0;
            self.k += 1;
        }
        (batch_bytes(&[stored]), BATCH_BLOCKS as u64, 0)
    }
}

#[derive(Default)]
pub(crate) struct Published {
    pub(crate) batches: AtomicU64,
    pub(crate) stored: AtomicU64,
    pub(crate) removed: AtomicU64,
    pub(crate) errors: AtomicU64,
}

/// Runs every publisher until `deadline`. `prefix` is the subject prefix (`kv` for the daemon,
/// `base` for the broker-only baseline). Returns what was published (and, for JetStream,
/// acknowledged by the stream).
pub(crate) async fn publish(
    o: &Options,
    nats_url: &str,
    mode: Mode,
    prefix: &str,
    payloads: Arc<Payloads>,
    workers: Arc<Mutex<Vec<SimWorker>>>,
    deadline: Instant,
) -> Arc<Published> {
    let published = Arc::new(Published::default());
    let mut tasks = Vec::new();
    // Each connection takes its workers out of the shared list and puts them back, so the next
    // phase continues every worker's stream (and its Kv-Seq) where this one stopped.
    let mut shares: Vec<Vec<SimWorker>> = (0..o.publishers).map(|_| Vec::new()).collect();
    for worker in std::mem::take(&mut *workers.lock().unwrap()) {
        let p = worker.w % o.publishers;
        shares[p].push(worker);
    }
    for mine in shares {
        let client = async_nats::ConnectOptions::new()
            .connect(nats_url)
            .await
            .expect("publisher connects");
        let (payloads, published, workers) = (payloads.clone(), published.clone(), workers.clone());
        let (window, prefix) = (o.window, prefix.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut mine = mine;
            let js = async_nats::jetstream::new(client.clone());
            let mut inflight = VecDeque::new();
            let (mut batches, mut stored, mut removed) = (0u64, 0u64, 0u64);
            'outer: loop {
                for worker in mine.iter_mut() {
                    if Instant::now() >= deadline {
                        break 'outer;
                    }
                    let (payload, s, r) = worker.next(&payloads);
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert("Kv-Seq", worker.seq.to_string().as_str());
                    let subject = format!("{prefix}{}", &worker.subject);
                    match mode {
                        Mode::JetStream => {
                            match js.publish_with_headers(subject, headers, payload).await {
                                Ok(ack) => inflight.push_back((ack, s, r)),
                                Err(_) => {
                                    published.errors.fetch_add(1, Ordering::Relaxed);
                                    continue;
                                }
                            }
                            if inflight.len() >= window {
                                let (ack, s, r) = inflight.pop_front().unwrap();
                                if ack.await.is_ok() {
                                    batches += 1;
                                    stored += s;
                                    removed += r;
                                } else {
                                    published.errors.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                        Mode::Core => {
                            if client
                                .publish_with_headers(subject, headers, payload)
                                .await
                                .is_ok()
                            {
                                batches += 1;
                                stored += s;
                                removed += r;
                            } else {
                                published.errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
            }
            for (ack, s, r) in inflight {
                match tokio::time::timeout(Duration::from_secs(10), ack).await {
                    Ok(Ok(_)) => {
                        batches += 1;
                        stored += s;
                        removed += r;
                    }
                    _ => {
                        published.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            let _ = tokio::time::timeout(Duration::from_secs(10), client.flush()).await;
            published.batches.fetch_add(batches, Ordering::Relaxed);
            published.stored.fetch_add(stored, Ordering::Relaxed);
            published.removed.fetch_add(removed, Ordering::Relaxed);
            workers.lock().unwrap().extend(mine);
        }));
    }
    for t in tasks {
        t.await.expect("publisher task");
    }
    workers.lock().unwrap().sort_by_key(|w| w.w);
    published
}

pub(crate) fn sim_workers(o: &Options) -> Arc<Mutex<Vec<SimWorker>>> {
    Arc::new(Mutex::new(
        (0..o.publishers * o.workers_per_publisher)
            .map(|w| SimWorker {
                subject: format!(".events.w{w:03}"),
                w,
                seq: 0,
                k: 0,
                i: 0,
                evicted: false,
            })
            .collect(),
    ))
}

/// Publishes a load sample for every simulated worker every `5s` until dropped, as a real
/// worker's metrics loop does. Without it the workers fall silent once publishing stops, and
/// the later route phases run into `worker_ttl` (60s): every worker ages out, and routes get
/// `503`s.
pub(crate) struct Heartbeat(tokio::task::JoinHandle<()>);

impl Heartbeat {
    pub(crate) async fn start(nats_url: &str, workers: usize) -> Heartbeat {
        let client = async_nats::connect(nats_url).await.unwrap();
        let sample = Bytes::from(encode_load(0.3, 4, 0, Some(64), 0.0, None));
        Heartbeat(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                for w in 0..workers {
                    // A lost sample is made up 5s later; the daemon counts any it rejects.
                    let _ = client
                        .publish(format!("kv.load.w{w:03}"), sample.clone())
                        .await;
                }
            }
        }))
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}
