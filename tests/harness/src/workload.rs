//! Deterministic multi-turn chat workloads with shared system prompts: the traffic kvroute is
//! built for (docs/design.md §4: each turn re-sends the whole conversation, so the pod that served the last
//! turn holds all but the newest message; conversations that share a system prompt share a prefix).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

const WORDS: &[&str] = &[
    "the",
    "pod",
    "cache",
    "router",
    "request",
    "token",
    "block",
    "prefix",
    "latency",
    "engine",
    "queue",
    "model",
    "adapter",
    "gateway",
    "cluster",
    "policy",
    "support",
    "customer",
    "invoice",
    "refund",
    "account",
    "order",
    "shipping",
    "warranty",
    "product",
    "manual",
    "section",
    "clause",
    "limit",
    "service",
    "answer",
    "question",
    "always",
    "never",
    "politely",
    "explain",
    "summarise",
    "verify",
    "escalate",
    "record",
    "within",
    "before",
    "after",
    "during",
    "because",
    "unless",
    "and",
    "or",
    "with",
    "for",
    "to",
    "of",
    "in",
    "on",
    "a",
    "is",
];

/// One conversation: which system prompt it uses and its user messages, one per turn.
#[derive(Clone, Debug)]
pub struct Conversation {
    pub id: usize,
    pub system_prompt: usize,
    pub user_messages: Vec<String>,
}

/// A set of system prompts and the conversations that use them.
#[derive(Clone, Debug)]
pub struct Workload {
    pub system_prompts: Vec<String>,
    pub conversations: Vec<Conversation>,
}

impl Workload {
    /// `prompts` system prompts of about `system_words` words, `per_prompt` conversations each,
    /// `turns` user messages of about `user_words` words per conversation. Same seed, same text.
    pub fn multi_turn_chat(
        seed: u64,
        prompts: usize,
        per_prompt: usize,
        turns: usize,
        system_words: usize,
        user_words: usize,
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let system_prompts = (0..prompts)
            .map(|i| format!("You are support assistant #{i} of kvroute. {}", sentence(&mut rng, system_words)))
            .collect();
        let conversations = (0..prompts * per_prompt)
            .map(|id| Conversation {
                id,
                system_prompt: id % prompts,
                user_messages: (0..turns)
                    .map(|t| format!("Question {t}: {}?", sentence(&mut rng, user_words)))
                    .collect(),
            })
            .collect();
        Self { system_prompts, conversations }
    }

    /// The `messages` of conversation `c` at turn `turn` (0-based), given the assistant replies
    /// of its earlier turns.
    pub fn messages(&self, c: &Conversation, turn: usize, replies: &[String]) -> Vec<Value> {
        let mut m = vec![json!({"role": "system", "content": self.system_prompts[c.system_prompt]})];
        for t in 0..turn {
            m.push(json!({"role": "user", "content": c.user_messages[t]}));
            m.push(json!({"role": "assistant", "content": replies.get(t).cloned().unwrap_or_default()}));
        }
        m.push(json!({"role": "user", "content": c.user_messages[turn]}));
        m
    }
}

/// One request of an open-loop chat stream: when it is due (seconds from the run's start) and
/// which turn of which conversation it is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScheduledTurn {
    pub at_s: f64,
    pub conversation: usize,
    pub turn: usize,
}

impl Workload {
    /// Seeded stand-in assistant replies, `words` words each: `[conversation][turn]`. Earlier turns
    /// carry these instead of what the engine said, so every router is sent byte-identical
    /// prompts whatever its engines answered (the same request stream for every layout).
    pub fn synthetic_replies(&self, seed: u64, words: usize) -> Vec<Vec<String>> {
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(0x9E37_79B9_7F4A_7C15));
        self.conversations
            .iter()
            .map(|c| {
                (0..c.user_messages.len()).map(|t| format!("Answer {t}: {}.", sentence(&mut rng, words))).collect()
            })
            .collect()
    }

    /// Every turn of every conversation on one seeded Poisson clock of `rate` requests per
    /// second (must be finite and positive: an empty schedule otherwise). Each arrival goes to a
    /// conversation drawn uniformly among those with turns left, so a conversation's turns come
    /// in order and spread over the run, interleaved with the others'. Sorted by `at_s`.
    pub fn open_loop_schedule(&self, seed: u64, rate: f64) -> Vec<ScheduledTurn> {
        if !(rate.is_finite() && rate > 0.0) {
            return Vec::new();
        }
        let mut rng = StdRng::seed_from_u64(seed);
        let mut left: Vec<(usize, usize)> =
            self.conversations.iter().filter(|c| !c.user_messages.is_empty()).map(|c| (c.id, 0)).collect();
        let turns: Vec<usize> = self.conversations.iter().map(|c| c.user_messages.len()).collect();
        let mut out = Vec::with_capacity(turns.iter().sum());
        let mut at = 0.0;
        while !left.is_empty() {
            at -= rng.random_range(f64::EPSILON..1.0f64).ln() / rate;
            let i = rng.random_range(0..left.len());
            let (conversation, turn) = left[i];
            out.push(ScheduledTurn { at_s: at, conversation, turn });
            if turn + 1 < turns[conversation] {
                left[i].1 += 1;
            } else {
                left.swap_remove(i);
            }
        }
        out
    }
}

fn sentence(rng: &mut StdRng, words: usize) -> String {
    let mut s = String::with_capacity(words * 7);
    for i in 0..words {
        if i > 0 {
            s.push(if rng.random_ratio(1, 12) { '.' } else { ' ' });
            if s.ends_with('.') {
                s.push(' ');
            }
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

/// `n` words from a seeded generator (`word` + a number below 97, from ten stems): distinct,
/// reproducible text for prompts that share nothing unless their seeds do. With the Qwen2.5
/// tokenizer about 3 tokens a word.
pub fn seeded_words(seed: u64, n: usize) -> String {
    const STEMS: [&str; 10] =
        ["river", "stone", "cloud", "amber", "signal", "harbor", "lattice", "meadow", "copper", "orbit"];
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            format!("{}{}", STEMS[(x >> 33) as usize % STEMS.len()], (x >> 40) % 97)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_loop_schedule_sends_every_turn_once_in_order_at_about_the_rate() {
        let w = Workload::multi_turn_chat(1, 24, 5, 3, 10, 5);
        let s = w.open_loop_schedule(1, 4.0);
        assert_eq!(s.len(), 24 * 5 * 3);
        assert!(s.windows(2).all(|p| p[0].at_s < p[1].at_s), "arrivals in time order");
        let mut next = vec![0usize; w.conversations.len()];
        for x in &s {
            assert_eq!(x.turn, next[x.conversation], "conversation {}'s turns in order", x.conversation);
            next[x.conversation] += 1;
        }
        assert!(next.iter().all(|&n| n == 3));
        // 360 Poisson arrivals at 4/s: the last one near 90 s (sd ≈ 4.7 s).
        let end = s.last().unwrap().at_s;
        assert!((70.0..110.0).contains(&end), "{end}");
        // Turns interleave: some conversation's second turn comes before another's first.
        let first_second = s.iter().position(|x| x.turn == 1).unwrap();
        let last_first = s.iter().rposition(|x| x.turn == 0).unwrap();
        assert!(first_second < last_first);
        assert_eq!(s, w.open_loop_schedule(1, 4.0), "same seed, same stream");
        assert_ne!(s, w.open_loop_schedule(2, 4.0));
        assert!(w.open_loop_schedule(1, 0.0).is_empty() && w.open_loop_schedule(1, f64::NAN).is_empty());
    }

    #[test]
    fn synthetic_replies_are_seeded_one_per_turn() {
        let w = Workload::multi_turn_chat(1, 2, 2, 3, 10, 5);
        let r = w.synthetic_replies(7, 20);
        assert_eq!(r.len(), 4);
        assert!(r.iter().all(|c| c.len() == 3));
        assert_eq!(r, w.synthetic_replies(7, 20));
        assert_ne!(r, w.synthetic_replies(8, 20));
        assert_ne!(r[0][0], r[1][0]);
    }
}
