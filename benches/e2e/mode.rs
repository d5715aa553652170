//! One NATS mode.

use super::*;

/// What the publishers and the load generator send, built before any clock starts.
pub(crate) struct Workload {
    pub(crate) payloads: Arc<Payloads>,
    /// Route bodies of 1k–32k tokens.
    pub(crate) mixed: Arc<Vec<Bytes>>,
    /// Route bodies of 4,096 tokens.
    pub(crate) four_k: Arc<Vec<Bytes>>,
    /// The same prompts as `four_k`, as block keys.
    pub(crate) four_k_keys: Arc<Vec<Bytes>>,
}

pub(crate) async fn run_mode(
    o: &Options,
    mode: Mode,
    w: &Workload,
    floor: Option<SocketAddr>,
    report: &mut Report,
    tck: f64,
) {
    let (payloads, mixed, four_k) = (w.payloads.clone(), w.mixed.clone(), w.four_k.clone());
    let four_k_keys = w.four_k_keys.clone();
    // With `--keep-data` the daemon writes into the kept dir itself (nothing is copied after
    // the run), else into a temporary one.
    let temp = TempDir::new().unwrap();
    let dir = match &o.keep_data {
        Some(keep) => {
            let to = keep.join(mode.name());
            assert!(!to.exists(), "--keep-data: {} exists already", to.display());
            std::fs::create_dir_all(&to).unwrap();
            to
        }
        None => temp.path().to_path_buf(),
    };
    // The test kit's nats-server, which the watchdog kills too.
    let nats = Watched::new(Nats::start());
    let nats_url = nats.url();
    let me = std::process::id();
    report.line(format!(
        "\n== {} ({} publisher connections × {} workers, 32-block batches) ==",
        mode.name(),
        o.publishers,
        o.workers_per_publisher
    ));

    // 1. The broker alone.
    let baseline = {
        let client = async_nats::connect(&nats_url).await.unwrap();
        let received = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let counter = if mode == Mode::Core {
            let mut sub = client.subscribe("base.events.>").await.unwrap();
            let (received, stop) = (received.clone(), stop.clone());
            Some(tokio::spawn(async move {
                loop {
                    match tokio::time::timeout(Duration::from_millis(200), sub.next()).await {
                        Ok(Some(_)) => {
                            received.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(None) => break,
                        Err(_) if stop.load(Ordering::Relaxed) => break,
                        Err(_) => {}
                    }
                }
            }))
        } else {
            let js = async_nats::jetstream::new(client.clone());
            js.create_stream(async_nats::jetstream::stream::Config {
                name: "BASELINE".into(),
                subjects: vec!["base.events.>".into()],
                storage: async_nats::jetstream::stream::StorageType::File,
                ..Default::default()
            })
            .await
            .expect("baseline stream");
            None
        };
        let pids = Pids {
            daemon: me,
            nats: nats.pid(),
            me,
        };
        let window = pids.sample();
        let start = Instant::now();
        let published = publish(
            o,
            &nats_url,
            mode,
            "base",
            payloads.clone(),
            sim_workers(o),
            start + o.duration,
        )
        .await;
        let secs = start.elapsed().as_secs_f64();
        let (_, nats_cpu, me_cpu) = pids.usage(&window, tck);
        if let Some(counter) = counter {
            tokio::time::sleep(Duration::from_millis(200)).await;
            stop.store(true, Ordering::Relaxed);
            let _ = tokio::time::timeout(Duration::from_secs(2), counter).await;
        } else {
            let js = async_nats::jetstream::new(client.clone());
            let _ = js.delete_stream("BASELINE").await;
        }
        let events = (published.stored.load(Ordering::Relaxed)
            + published.removed.load(Ordering::Relaxed)) as f64;
        let published_rate = events / secs;
        // JetStream: what the stream acknowledged. Core NATS: what reached a subscriber (each
        // message is one 32-block event).
        let rate = match mode {
            Mode::JetStream => published_rate,
            Mode::Core => received.load(Ordering::Relaxed) as f64 * BATCH_BLOCKS as f64 / secs,
        };
        report.line(format!(
            "broker only: {rate:.0} block events/s {} ({published_rate:.0}/s published; nats-server {nats_cpu:.2} cores, bench {me_cpu:.2}; {} publish errors)",
            match mode {
                Mode::JetStream => "published and acknowledged by the stream",
                Mode::Core => "delivered to a subscriber that only counts them",
            },
            published.errors.load(Ordering::Relaxed),
        ));
        rate
    };

    // 2. Ingest into the daemon.
    let (mut daemon, http) = start_daemon(&dir, &nats_url, mode, o.keep_data.is_some()).await;
    if mode == Mode::Core {
        // Core NATS readiness does not wait for the subscriptions to reach the server.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let _heartbeat = Heartbeat::start(&nats_url, o.publishers * o.workers_per_publisher).await;
    let pids = Pids {
        daemon: daemon.pid(),
        nats: nats.pid(),
        me,
    };
    let client = reqwest::Client::new();
    let workers = sim_workers(o);
    let c0 = counters(&client, http).await;
    let window = pids.sample();
    let start = Instant::now();
    let published = publish(
        o,
        &nats_url,
        mode,
        "kv",
        payloads.clone(),
        workers.clone(),
        start + o.duration,
    )
    .await;
    let publish_secs = start.elapsed().as_secs_f64();
    let c1 = counters(&client, http).await;
    let at_end = start.elapsed().as_secs_f64();
    let (d_cpu, n_cpu, b_cpu) = pids.usage(&window, tck);
    let pub_stored = published.stored.load(Ordering::Relaxed) as f64;
    let pub_removed = published.removed.load(Ordering::Relaxed) as f64;
    // Drain: wait until the daemon has applied everything published (JetStream) or the
    // counter stops moving (core NATS may have dropped messages), at most 60 s.
    let drain_start = Instant::now();
    let mut last = c1.clone();
    let mut still = 0;
    while drain_start.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let c = counters(&client, http).await;
        if c.stored + c.removed >= c0.stored + c0.removed + pub_stored + pub_removed {
            last = c;
            break;
        }
        still = if c.stored + c.removed == last.stored + last.removed {
            still + 1
        } else {
            0
        };
        last = c;
        if still >= 8 {
            break;
        }
    }
    let drain_secs = drain_start.elapsed().as_secs_f64();
    daemon.assert_running();
    let events = |c: &Counters| c.stored + c.removed;
    let pub_events = pub_stored + pub_removed;
    let applied_in_window = (events(&c1) - events(&c0)) / at_end;
    let stored_in_window = (c1.stored - c0.stored) / at_end;
    let applied_total = events(&last) - events(&c0);
    let drain_rate = (events(&last) - events(&c1)) / drain_secs.max(1e-9);
    let (rss, hwm) = rss_mib(daemon.pid());
    report.line(format!(
        "ingest: published {:.0} block events/s ({:.0} stored + {:.0} removed, 32 per message); the daemon applied {applied_in_window:.0} block events/s while they were published ({stored_in_window:.0} stored/s; {:.2}× the broker-only rate)",
        pub_events / publish_secs,
        pub_stored / publish_secs,
        pub_removed / publish_secs,
        applied_in_window / baseline.max(1.0),
    ));
    report.line(format!(
        "  in the end {applied_total:.0} of {pub_events:.0} published block events applied ({:.1}%); the backlog left when publishing stopped ({:.0}) took {drain_secs:.1} s ({drain_rate:.0}/s); seq gaps {:.0}",
        100.0 * applied_total / pub_events.max(1.0),
        (events(&c0) + pub_events - events(&c1)).max(0.0),
        last.gaps - c0.gaps,
    ));
    report.line(format!(
        "  cpu during publishing: daemon {d_cpu:.2} cores, nats-server {n_cpu:.2}, bench (publishers) {b_cpu:.2}; daemon RSS {rss:.0} MiB (peak {hwm:.0})"
    ));
    report.json.push(format!(
        "{{\"mode\":\"{}\",\"phase\":\"ingest\",\"broker_only_events_per_s\":{baseline:.0},\"published_events_per_s\":{:.0},\"applied_events_per_s\":{applied_in_window:.0},\"applied_stored_per_s\":{stored_in_window:.0},\"applied_fraction\":{:.4},\"drain_events_per_s\":{drain_rate:.0},\"daemon_cores\":{d_cpu:.2},\"nats_cores\":{n_cpu:.2},\"bench_cores\":{b_cpu:.2},\"daemon_rss_mib\":{rss:.0},\"daemon_peak_rss_mib\":{hwm:.0}}}",
        mode.name(),
        pub_events / publish_secs,
        applied_total / pub_events.max(1.0),
    ));

    // 3. Routes over the index the ingest phase built.
    let url = format!("http://{http}/v1/route");
    let solo_p99_us = {
        let c0 = counters(&client, http).await;
        let window = pids.sample();
        let load = http_load(&url, mixed.clone(), o.concurrency, o.duration).await;
        let (d_cpu, _, b_cpu) = pids.usage(&window, tck);
        let c1 = counters(&client, http).await;
        let server_mean =
            1e6 * (c1.route_sum - c0.route_sum) / (c1.route_count - c0.route_count).max(1.0);
        let (rss, _) = rss_mib(daemon.pid());
        let label = format!("routes 1k-32k tokens, concurrency {}", o.concurrency);
        report.line(load_line(&label, &load));
        report.line(format!(
            "    daemon handler mean {server_mean:.1} µs (kvrouted_route_duration_seconds); decisions: {}; cpu daemon {d_cpu:.2} cores, bench {b_cpu:.2}; RSS {rss:.0} MiB",
            c1.decisions_since(&c0)
        ));
        report.json.push(format!(
            "{{\"mode\":\"{}\",\"phase\":\"{label}\",\"load\":{},\"daemon_handler_mean_us\":{server_mean:.1},\"daemon_cores\":{d_cpu:.2},\"daemon_rss_mib\":{rss:.0}}}",
            mode.name(),
            load_json(&load)
        ));
        load.p99_us
    };

    // 4. 4k-token routes against the HTTP floor, interleaved so both see the same machine.
    let mut against_parse_floor = None;
    if let Some(floor) = floor {
        let runs = [
            (BodyKind::Tokens, 1),
            (BodyKind::Tokens, o.concurrency),
            (BodyKind::BlockKeys, 1),
        ];
        for (kind, concurrency) in runs {
            let bodies = match kind {
                BodyKind::Tokens => four_k.clone(),
                BodyKind::BlockKeys => four_k_keys.clone(),
            };
            let ratio = paired_4k(
                o,
                PairedTargets {
                    route: &url,
                    floor,
                    daemon: http,
                },
                &pids,
                (kind, bodies),
                concurrency,
                mode,
                report,
                tck,
            )
            .await;
            if (kind, concurrency) == (BodyKind::Tokens, o.concurrency) {
                against_parse_floor = Some(ratio);
            }
        }
    }

    // 5. Both at once.
    let c0 = counters(&client, http).await;
    let window = pids.sample();
    let start = Instant::now();
    let (published, load) = tokio::join!(
        publish(
            o,
            &nats_url,
            mode,
            "kv",
            payloads.clone(),
            workers.clone(),
            start + o.duration
        ),
        http_load(&url, mixed.clone(), o.concurrency, o.duration)
    );
    let c1 = counters(&client, http).await;
    let secs = start.elapsed().as_secs_f64();
    let (d_cpu, n_cpu, b_cpu) = pids.usage(&window, tck);
    let (rss, hwm) = rss_mib(daemon.pid());
    daemon.assert_running();
    let combined_ingest_per_s = (c1.stored + c1.removed - c0.stored - c0.removed) / secs;
    report.line(format!(
        "combined: published {:.0} block events/s, the daemon applied {combined_ingest_per_s:.0}/s while serving",
        (published.stored.load(Ordering::Relaxed) + published.removed.load(Ordering::Relaxed))
            as f64
            / secs,
    ));
    report.line(load_line(
        &format!("routes 1k-32k tokens, concurrency {}", o.concurrency),
        &load,
    ));
    report.line(format!(
        "    decisions: {}; cpu daemon {d_cpu:.2} cores, nats-server {n_cpu:.2}, bench {b_cpu:.2}; daemon RSS {rss:.0} MiB (peak {hwm:.0})",
        c1.decisions_since(&c0)
    ));
    report.json.push(format!(
        "{{\"mode\":\"{}\",\"phase\":\"combined\",\"applied_events_per_s\":{combined_ingest_per_s:.0},\"load\":{},\"daemon_cores\":{d_cpu:.2},\"nats_cores\":{n_cpu:.2},\"daemon_peak_rss_mib\":{hwm:.0}}}",
        mode.name(),
        load_json(&load)
    ));
    let goals = Goals {
        ingest_per_s: applied_in_window,
        solo_p99_us,
        against_parse_floor,
        combined_p99_us: load.p99_us,
        combined_ingest_per_s,
    };
    report.line(format!("goals ({}):", mode.name()));
    for line in goals.verdicts(o.concurrency) {
        report.line(format!("  {line}"));
    }
    // Stopped as an operator stops it, while the broker is still up to take its last acks.
    if !daemon.stop() {
        report.line(format!(
            "the daemon did not exit within {} of SIGTERM; killed",
            humantime::format_duration(STOP_TIMEOUT)
        ));
    }
    drop(daemon);
    drop(nats);
    if o.keep_data.is_some() {
        report.line(format!(
            "kept the daemon's data dir and log in {} (`kvrouted replay --data-dir {}`)",
            dir.display(),
            dir.join("data").display()
        ));
    }
}
