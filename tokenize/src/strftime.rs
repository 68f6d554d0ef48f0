//! `strftime_now(format)`, the template global transformers provides (Llama 3 templates print
//! today's date with it). Python uses local time; the picker runs in containers on UTC, so this
//! formats UTC. Supports the C89 directives templates use; an unknown directive is copied
//! through unchanged, as glibc does. Pure function of the clock, no shared state.

use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// A broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UtcTime {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Monday
    weekday: u32,
    /// 1..=366
    yday: u32,
}

impl UtcTime {
    /// Breaks down seconds since the Unix epoch (UTC).
    pub fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        // Howard Hinnant's civil_from_days.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        const CUM: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let yday = CUM[(month - 1) as usize] + day + u32::from(leap && month > 2);
        Self {
            year,
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem % 3600 / 60) as u32,
            second: (rem % 60) as u32,
            weekday: (days + 3).rem_euclid(7) as u32, // 1970-01-01 was a Thursday
            yday,
        }
    }

    /// The current time.
    pub fn now() -> Self {
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        Self::from_unix(secs)
    }

    /// Python's `strftime` for the directives `aAbBdeHIjmMpSyYZz%` (C locale).
    pub fn format(&self, fmt: &str) -> String {
        let mut out = String::with_capacity(fmt.len() + 16);
        let mut chars = fmt.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let Some(d) = chars.next() else {
                out.push('%');
                break;
            };
            let month = MONTHS[(self.month - 1) as usize];
            let weekday = WEEKDAYS[self.weekday as usize];
            match d {
                'Y' => out.push_str(&self.year.to_string()),
                'y' => out.push_str(&format!("{:02}", self.year.rem_euclid(100))),
                'm' => out.push_str(&format!("{:02}", self.month)),
                'd' => out.push_str(&format!("{:02}", self.day)),
                'e' => out.push_str(&format!("{:>2}", self.day)),
                'H' => out.push_str(&format!("{:02}", self.hour)),
                'I' => out.push_str(&format!("{:02}", (self.hour + 11) % 12 + 1)),
                'p' => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                'M' => out.push_str(&format!("{:02}", self.minute)),
                'S' => out.push_str(&format!("{:02}", self.second)),
                'j' => out.push_str(&format!("{:03}", self.yday)),
                'b' | 'h' => out.push_str(&month[..3]),
                'B' => out.push_str(month),
                'a' => out.push_str(&weekday[..3]),
                'A' => out.push_str(weekday),
                'Z' => out.push_str("UTC"),
                'z' => out.push_str("+0000"),
                '%' => out.push('%'),
                other => {
                    out.push('%');
                    out.push(other);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_instants() {
        // 2024-02-29T13:05:09Z, a Thursday, day 60 of a leap year.
        let t = UtcTime::from_unix(1_709_211_909);
        assert_eq!(t.format("%d %b %Y"), "29 Feb 2024");
        assert_eq!(t.format("%A %B %e, %y %H:%M:%S %I%p %j %% %Q"), "Thursday February 29, 24 13:05:09 01PM 060 % %Q");
        let epoch = UtcTime::from_unix(0);
        assert_eq!(epoch.format("%Y-%m-%d %a"), "1970-01-01 Thu");
        let before = UtcTime::from_unix(-1);
        assert_eq!(before.format("%Y-%m-%d %H:%M:%S %j"), "1969-12-31 23:59:59 365");
    }
}
