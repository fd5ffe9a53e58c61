//! Blocking storage work on the async runtime.
//!
//! A redb write transaction takes the database's single writer lock and, on commit, an
//! fsync: milliseconds when idle, far more when many range groups append at once (every range
//! of a node shares `ranges.redb`). pgmr runs two runtime workers; a write made inline on both
//! of them stalls every other task — the meta group's heartbeats among them, whose read-index
//! rounds then fail for want of a quorum ("not enough for a quorum", seen during a 9-node
//! `configure-multi-region`).

/// Runs `f`, a blocking storage call, without stalling the runtime's other tasks: on the
/// multi-threaded runtime the worker first hands its queue to another thread
/// (`block_in_place`); elsewhere (a current-thread test runtime, no runtime) `f` just runs.
pub fn run<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::run;

    #[test]
    fn runs_outside_a_runtime() {
        assert_eq!(run(|| 7), 7);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn runs_on_a_current_thread_runtime() {
        assert_eq!(run(|| 8), 8);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lets_other_tasks_run_while_blocking() {
        // Both workers block; a third task still runs, on the threads block_in_place frees.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        let blockers: Vec<_> = (0..2)
            .map(|_| {
                let rx = rx.clone();
                tokio::spawn(async move {
                    run(|| {
                        let _ = rx
                            .lock()
                            .unwrap()
                            .recv_timeout(std::time::Duration::from_secs(10));
                    })
                })
            })
            .collect();
        let ticker = tokio::spawn(async {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            "ran"
        });
        assert_eq!(
            tokio::time::timeout(std::time::Duration::from_secs(5), ticker)
                .await
                .expect("another task ran while both workers blocked")
                .unwrap(),
            "ran"
        );
        for _ in 0..2 {
            tx.send(()).unwrap();
        }
        for b in blockers {
            b.await.unwrap();
        }
    }
}
