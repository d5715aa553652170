//! A timeline of scheduled events, shared by the simulator and the live demo: the earliest time
//! first, and among equal times the one scheduled first, so every run replays in one order.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Events of type `E` at microsecond times.
#[derive(Debug)]
pub(crate) struct Timeline<E> {
    heap: BinaryHeap<Scheduled<E>>,
    /// Scheduling order, the tie-breaker among equal times.
    order: u64,
}

impl<E> Default for Timeline<E> {
    fn default() -> Self {
        Timeline {
            heap: BinaryHeap::new(),
            order: 0,
        }
    }
}

impl<E> Timeline<E> {
    pub(crate) fn schedule(&mut self, at_us: u64, ev: E) {
        self.order += 1;
        self.heap.push(Scheduled {
            at_us,
            order: self.order,
            ev,
        });
    }

    /// The next event and its time.
    pub(crate) fn pop(&mut self) -> Option<(u64, E)> {
        self.heap.pop().map(|s| (s.at_us, s.ev))
    }

    /// The next event and its time, if it is due at `now_us`.
    pub(crate) fn pop_due(&mut self, now_us: u64) -> Option<(u64, E)> {
        if self.heap.peek()?.at_us <= now_us {
            self.pop()
        } else {
            None
        }
    }

    /// When the next event is due.
    pub(crate) fn next_at_us(&self) -> Option<u64> {
        self.heap.peek().map(|s| s.at_us)
    }

    pub(crate) fn clear(&mut self) {
        self.heap.clear();
    }
}

#[derive(Debug)]
struct Scheduled<E> {
    at_us: u64,
    order: u64,
    ev: E,
}

impl<E> PartialEq for Scheduled<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at_us, self.order) == (other.at_us, other.order)
    }
}
impl<E> Eq for Scheduled<E> {}
impl<E> PartialOrd for Scheduled<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Scheduled<E> {
    /// Reversed: `BinaryHeap` pops the greatest, and the earliest must come first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at_us, other.order).cmp(&(self.at_us, self.order))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_come_out_by_time_then_in_the_order_they_were_scheduled() {
        let mut t = Timeline::default();
        t.schedule(20, "late");
        t.schedule(10, "first at 10");
        t.schedule(10, "second at 10");
        assert_eq!(t.next_at_us(), Some(10));
        assert_eq!(t.pop_due(5), None, "nothing is due before its time");
        assert_eq!(t.pop(), Some((10, "first at 10")));
        assert_eq!(
            t.pop(),
            Some((10, "second at 10")),
            "equal times keep their order"
        );
        assert_eq!(t.pop_due(20), Some((20, "late")));
        assert_eq!(t.pop(), None);
    }
}
