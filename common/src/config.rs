//! What the agent's and the picker's config errors share: [`InvalidField`], a value out of range
//! or inconsistent, named by its field, with its value and what to do (STYLE: a user-facing error
//! says what was wrong, where, and what to do).

use std::fmt::Display;

/// One configuration field with a value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} = {value}: {fix}")]
pub struct InvalidField {
    /// Which field, as written in the file, e.g. `models["m"].mode` or `engines["p"].endpoint`.
    pub field: String,
    /// Its value as given.
    pub value: String,
    /// What is wrong with it and what to do.
    pub fix: String,
}

impl InvalidField {
    /// `field` = `value`, with `fix`.
    pub fn new(field: impl Into<String>, value: impl Display, fix: impl Into<String>) -> Self {
        Self { field: field.into(), value: value.to_string(), fix: fix.into() }
    }
}
