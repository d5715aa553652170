//! The order of one durable consumer's deliveries in this process.

/// Where a delivery stands against what this process handed over from the same consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Delivery {
    /// The next message: hand it over.
    Next,
    /// A message handed over before (delivered again after a rewind): skip it.
    Handed,
    /// Deliveries before this one never arrived (a server of the cluster went away with them).
    Lost { missing: u64 },
}

/// The order of one durable consumer's deliveries in this process. A consumer numbers every
/// delivery (`consumer_sequence`, redeliveries included), so a skipped number is a delivery
/// that was lost in transit. It must not be stepped over: acknowledging a later message
/// cumulatively would acknowledge the lost one, and a KV event applied out of order is applied
/// wrong. The consumer is rewound instead (see `jetstream::rewind_consumer`).
#[derive(Debug, Default)]
pub(super) struct DeliveryOrder {
    last_consumer_seq: Option<u64>,
    /// Every message of the stream up to here was handed over (or deliberately skipped).
    pub(super) last_stream_seq: u64,
}

impl DeliveryOrder {
    pub(super) fn check(&mut self, consumer_seq: u64, stream_seq: u64) -> Delivery {
        if let Some(last) = self.last_consumer_seq {
            if consumer_seq > last + 1 {
                return Delivery::Lost {
                    missing: consumer_seq - last - 1,
                };
            }
        }
        // A number at or below the last one: a new consumer leader numbering again; follow it.
        self.last_consumer_seq = Some(consumer_seq);
        if stream_seq <= self.last_stream_seq {
            return Delivery::Handed;
        }
        self.last_stream_seq = stream_seq;
        Delivery::Next
    }

    /// The consumer was created again: its numbering starts over; the stream's does not.
    pub(super) fn consumer_recreated(&mut self) {
        self.last_consumer_seq = None;
    }

    /// Expects the next delivery to follow `delivered`, the consumer's own count just before
    /// this process pulls from it. Without it the first delivery's number is taken as it comes,
    /// and deliveries lost before it (to a pull request of a process that died) would be
    /// acknowledged with it, unseen.
    pub(super) fn expect_after(&mut self, delivered: u64) {
        self.last_consumer_seq = Some(delivered);
    }

    /// How many deliveries the consumer counts beyond the last one that arrived here. Checked
    /// when the feed is quiet: a loss at the end of a burst has no later delivery to reveal it.
    pub(super) fn unseen(&self, delivered: u64) -> u64 {
        self.last_consumer_seq
            .map_or(0, |last| delivered.saturating_sub(last))
    }
}

/// What a quiet feed's check of its consumer found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Quiet {
    /// Deliveries the consumer counts never arrived, at two checks in a row with nothing in
    /// between: lost, not in transit.
    Lost { missing: u64 },
    /// Nothing lost and nothing pending: every message the consumer can deliver arrived.
    NothingLeft,
    /// Nothing to act on yet.
    Wait,
}

/// The rule of a feed's quiet checks (`jetstream::QUIET_CHECK`): a loss at the end of a burst
/// has no later delivery to reveal it, so a feed with no delivery for a whole period asks its
/// consumer for its counts.
#[derive(Debug, Default)]
pub(super) struct QuietWatch {
    arrived: bool,
    unseen_before: bool,
}

impl QuietWatch {
    /// A delivery arrived.
    pub(super) fn arrived(&mut self) {
        self.arrived = true;
    }

    /// At the end of a period: whether none arrived during it, so the consumer is asked.
    pub(super) fn quiet(&mut self) -> bool {
        if std::mem::take(&mut self.arrived) {
            self.unseen_before = false;
            return false;
        }
        true
    }

    /// Judges the consumer's answer: deliveries it counts that never arrived here
    /// ([`DeliveryOrder::unseen`]), and messages it still has to deliver. An unanswered check
    /// is judged as `(0, 1)`: nothing found.
    pub(super) fn judge(&mut self, unseen: u64, pending: u64) -> Quiet {
        let lost = unseen > 0 && self.unseen_before;
        self.unseen_before = unseen > 0;
        match (unseen, pending) {
            _ if lost => Quiet::Lost { missing: unseen },
            (0, 0) => Quiet::NothingLeft,
            _ => Quiet::Wait,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unseen_deliveries_are_lost_only_at_two_quiet_checks_in_a_row() {
        let mut watch = QuietWatch::default();
        assert!(watch.quiet());
        assert_eq!(watch.judge(2, 0), Quiet::Wait, "once may be in transit");
        assert!(watch.quiet());
        assert_eq!(watch.judge(2, 0), Quiet::Lost { missing: 2 });

        let mut watch = QuietWatch::default();
        assert!(watch.quiet());
        assert_eq!(watch.judge(1, 0), Quiet::Wait);
        watch.arrived();
        assert!(!watch.quiet(), "a period with a delivery asks nothing");
        assert!(watch.quiet());
        assert_eq!(
            watch.judge(1, 0),
            Quiet::Wait,
            "a delivery between two checks starts the count over"
        );
        assert_eq!(watch.judge(0, 0), Quiet::NothingLeft);
        assert_eq!(watch.judge(0, 3), Quiet::Wait, "messages still to deliver");
    }

    #[test]
    fn after_a_start_at_the_consumers_count_a_first_delivery_past_it_is_a_lost_delivery() {
        let mut order = DeliveryOrder::default();
        order.expect_after(41);
        assert_eq!(
            order.check(43, 143),
            Delivery::Lost { missing: 1 },
            "delivery 42 went to a pull request nobody reads any more: not stepped over"
        );
        let mut order = DeliveryOrder::default();
        order.expect_after(41);
        assert_eq!(order.check(42, 142), Delivery::Next);
    }

    #[test]
    fn deliveries_the_consumer_counts_and_that_never_arrived_are_unseen() {
        let mut order = DeliveryOrder::default();
        assert_eq!(order.unseen(5), 0, "nothing to compare with before a start");
        order.expect_after(5);
        assert_eq!(order.check(6, 10), Delivery::Next);
        assert_eq!(order.unseen(6), 0);
        assert_eq!(
            order.unseen(8),
            2,
            "the consumer delivered 7 and 8, which never arrived"
        );
    }

    #[test]
    fn a_skipped_delivery_number_is_a_lost_delivery_and_nothing_after_it_is_handed_over() {
        let mut order = DeliveryOrder::default();
        assert_eq!(order.check(1, 10), Delivery::Next);
        assert_eq!(order.check(2, 11), Delivery::Next);
        assert_eq!(
            order.check(5, 14),
            Delivery::Lost { missing: 2 },
            "deliveries 3 and 4 never arrived: 5 must wait for them"
        );
        assert_eq!(
            order.check(5, 14),
            Delivery::Lost { missing: 2 },
            "a lost delivery does not advance the order"
        );
    }

    #[test]
    fn after_a_rewind_messages_handed_over_before_are_skipped_and_the_rest_follow_in_order() {
        let mut order = DeliveryOrder::default();
        for (cseq, sseq) in [(1, 10), (2, 11), (3, 12)] {
            assert_eq!(order.check(cseq, sseq), Delivery::Next);
        }
        order.consumer_recreated();
        assert_eq!(
            order.check(1, 11),
            Delivery::Handed,
            "the recreated consumer starts at the ack floor: handed over already"
        );
        assert_eq!(order.check(2, 12), Delivery::Handed);
        assert_eq!(order.check(3, 13), Delivery::Next, "then the first new one");
        assert_eq!(
            order.check(4, 12),
            Delivery::Handed,
            "a redelivery after ack_wait (a new delivery number, an old message) is skipped"
        );
    }
}
