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
