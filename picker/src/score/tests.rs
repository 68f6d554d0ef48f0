//! Scoring tests: formulas, properties, filters, selection.
