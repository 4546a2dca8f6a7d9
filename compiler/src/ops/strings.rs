//! String ops: StringConcat, StringSplit, StringNormalizer and RegexFullMatch.
//!
//! Compiled code holds a string tensor as an array of pointers to NUL-terminated strings
//! and never allocates, so it can only pass existing strings along or read their bytes.
//! RegexFullMatch compiles: its pattern becomes a deterministic automaton at compile
//! time, walked byte by byte at run time. StringConcat, StringNormalizer and StringSplit
//! make new string bytes whose sizes depend on the input data; they are refused with
//! that reason (the latter two already when shapes are inferred).

use super::util::{arr, input, out, outs};
use super::{OpCtx, Registry};
use crate::ir::{OpError, OpResult, Tensor, Value};
use crate::{bail, ensure};
use ndarray::{ArrayD, IxDyn};
use regex_syntax::ast::{self, Ast, ClassPerl, ClassPerlKind, ClassSetItem};
use std::collections::HashSet;

pub fn register(r: &mut Registry) {
    r.add("StringConcat", string_concat);
    r.add_dynamic("StringSplit", string_split);
    r.add_dynamic("StringNormalizer", string_normalizer);
    r.add("RegexFullMatch", regex_full_match);
    lower::register(r);
}

fn shaped<T>(shape: &[usize], v: Vec<T>) -> OpResult<ArrayD<T>> {
    ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|e| OpError::new(e.to_string()))
}

fn string_concat(_ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let a = arr::<String>(input(ins, 0)?)?;
    let b = arr::<String>(input(ins, 1)?)?;
    let r = super::util::zip_broadcast(a, b, |x, y| x + &y)?;
    out(Tensor::from_array(r))
}

/// Python's `str.split(sep, maxsplit)` (sep None: runs of whitespace, no empty parts).
fn py_split(s: &str, sep: Option<&str>, maxsplit: Option<usize>) -> Vec<String> {
    let mut parts = Vec::new();
    match sep {
        Some(sep) => {
            let mut rest = s;
            loop {
                if maxsplit.is_some_and(|m| parts.len() >= m) {
                    break;
                }
                match rest.find(sep) {
                    Some(i) => {
                        parts.push(rest[..i].to_string());
                        rest = &rest[i + sep.len()..];
                    }
                    None => break,
                }
            }
            parts.push(rest.to_string());
        }
        None => {
            let mut rest = s.trim_start();
            while !rest.is_empty() {
                if maxsplit.is_some_and(|m| parts.len() >= m) {
                    parts.push(rest.to_string());
                    break;
                }
                match rest.find(char::is_whitespace) {
                    Some(i) => {
                        parts.push(rest[..i].to_string());
                        rest = rest[i..].trim_start();
                    }
                    None => {
                        parts.push(rest.to_string());
                        break;
                    }
                }
            }
        }
    }
    parts
}

fn string_split(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = arr::<String>(input(ins, 0)?)?;
    let delim = ctx.attrs.get_string("delimiter")?.filter(|d| !d.is_empty());
    let maxsplit = match ctx.attrs.get_int("maxsplit")? {
        Some(m) => {
            ensure!(m >= 0, "StringSplit: maxsplit must be non-negative");
            Some(m as usize)
        }
        None => None,
    };
    let splits: Vec<Vec<String>> = x
        .iter()
        .map(|s| py_split(s, delim.as_deref(), maxsplit))
        .collect();
    let width = splits.iter().map(Vec::len).max().unwrap_or(0);
    let lens: Vec<i64> = splits.iter().map(|v| v.len() as i64).collect();
    let mut flat = Vec::with_capacity(splits.len() * width);
    for mut v in splits {
        v.resize(width, String::new());
        flat.extend(v);
    }
    let mut shape = x.shape().to_vec();
    shape.push(width);
    outs(vec![
        Tensor::from_array(shaped(&shape, flat)?),
        Tensor::from_array(shaped(x.shape(), lens)?),
    ])
}

fn string_normalizer(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = arr::<String>(input(ins, 0)?)?;
    let action = ctx.attrs.string("case_change_action", "NONE".into())?;
    let sensitive = ctx.attrs.int("is_case_sensitive", 0)? != 0;
    let stopwords = ctx.attrs.strings("stopwords", vec![])?;
    let change = |s: &str| -> OpResult<String> {
        Ok(match action.as_str() {
            "LOWER" => s.to_lowercase(),
            "UPPER" => s.to_uppercase(),
            "NONE" => s.to_string(),
            other => bail!("StringNormalizer: unknown case_change_action {other:?}"),
        })
    };
    let raw_stops: HashSet<&str> = stopwords.iter().map(String::as_str).collect();
    let stops: HashSet<String> = stopwords
        .iter()
        .map(|w| {
            change(w).map(|s| {
                if action == "NONE" {
                    s.to_lowercase()
                } else {
                    s
                }
            })
        })
        .collect::<OpResult<_>>()?;
    let remove = |text: &str, keep: &dyn Fn(&str) -> bool| -> String {
        text.split(' ')
            .filter(|w| keep(w))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut res = Vec::with_capacity(x.len());
    for s in x.iter() {
        let mut v = s.clone();
        if sensitive && !raw_stops.is_empty() {
            v = remove(&v, &|w| !raw_stops.contains(w));
        }
        v = change(&v)?;
        if !sensitive && !stops.is_empty() {
            let lower = action == "NONE";
            v = remove(&v, &|w| {
                if lower {
                    !stops.contains(&w.to_lowercase())
                } else {
                    !stops.contains(w)
                }
            });
        }
        res.push(v);
    }
    let shape = x.shape();
    let t = match shape.len() {
        1 => {
            let mut v: Vec<String> = res.into_iter().filter(|s| !s.is_empty()).collect();
            if v.is_empty() {
                v.push(String::new());
            }
            let n = v.len();
            shaped(&[n], v)?
        }
        2 if shape[0] == 1 => {
            let mut v: Vec<String> = res.into_iter().filter(|s| !s.is_empty()).collect();
            if v.is_empty() {
                v.push(String::new());
            }
            let n = v.len();
            shaped(&[1, n], v)?
        }
        2 => shaped(shape, res)?,
        _ => bail!("StringNormalizer: input must be [C] or [1, C]"),
    };
    out(Tensor::from_array(t))
}

// ---------------------------------------------------------------- RegexFullMatch

/// The ASCII forms of Perl classes and word boundaries found in a pattern: (start, end,
/// replacement) per occurrence.
struct Re2Ascii<'a> {
    pat: &'a str,
    edits: Vec<(usize, usize, String)>,
}

/// `\d`, `\s`, `\w` (and negations) as RE2 defines them: ASCII only. Inside a bracketed
/// class the set's items, or a nested class for a negation.
fn perl_ascii(c: &ClassPerl, in_class: bool) -> String {
    let set = match c.kind {
        ClassPerlKind::Digit => "0-9",
        ClassPerlKind::Space => r"\t\n\f\r\x20",
        ClassPerlKind::Word => "0-9A-Za-z_",
    };
    match (in_class, c.negated) {
        (true, false) => set.to_string(),
        (_, true) => format!("[^{set}]"),
        (false, false) => format!("[{set}]"),
    }
}

impl ast::Visitor for Re2Ascii<'_> {
    type Output = Vec<(usize, usize, String)>;
    type Err = std::convert::Infallible;

    fn finish(self) -> Result<Self::Output, Self::Err> {
        Ok(self.edits)
    }

    fn visit_pre(&mut self, a: &Ast) -> Result<(), Self::Err> {
        match a {
            Ast::ClassPerl(c) => {
                self.edits
                    .push((c.span.start.offset, c.span.end.offset, perl_ascii(c, false)))
            }
            Ast::Assertion(x)
                if !matches!(
                    x.kind,
                    ast::AssertionKind::StartLine
                        | ast::AssertionKind::EndLine
                        | ast::AssertionKind::StartText
                        | ast::AssertionKind::EndText
                ) =>
            {
                // A word boundary: ASCII, like \w.
                let (s, e) = (x.span.start.offset, x.span.end.offset);
                self.edits
                    .push((s, e, format!("(?-u:{})", &self.pat[s..e])));
            }
            _ => {}
        }
        Ok(())
    }

    fn visit_class_set_item_pre(&mut self, item: &ClassSetItem) -> Result<(), Self::Err> {
        if let ClassSetItem::Perl(c) = item {
            self.edits
                .push((c.span.start.offset, c.span.end.offset, perl_ascii(c, true)));
        }
        Ok(())
    }
}

/// A RegexFullMatch pattern as the `regex` crate should read it to mean what RE2 (the
/// syntax ONNX specifies) means: RE2's Perl classes and word boundaries are ASCII, the
/// regex crate's Unicode, so each becomes its ASCII spelling; the rest is kept.
pub(crate) fn re2_pattern(pat: &str) -> OpResult<String> {
    let bad = |e: &dyn std::fmt::Display| {
        OpError::new(format!("RegexFullMatch: invalid pattern {pat:?}: {e}"))
    };
    let tree = ast::parse::Parser::new().parse(pat).map_err(|e| bad(&e))?;
    let mut edits = match ast::visit(&tree, Re2Ascii { pat, edits: vec![] }) {
        Ok(v) => v,
        Err(e) => match e {},
    };
    edits.sort_by_key(|e| std::cmp::Reverse(e.0));
    let mut out = pat.to_string();
    for (s, e, r) in edits {
        out.replace_range(s..e, &r);
    }
    Ok(out)
}

/// The anchored pattern a RegexFullMatch node matches whole strings against.
fn full_match_pattern(ctx: &OpCtx) -> OpResult<String> {
    let pat = ctx
        .attrs
        .get_string("pattern")?
        .ok_or_else(|| OpError::new("RegexFullMatch: attribute `pattern` is required"))?;
    Ok(format!("^(?:{})$", re2_pattern(&pat)?))
}

fn regex_full_match(ctx: &OpCtx, ins: &[Option<&Value>]) -> OpResult<Vec<Value>> {
    let x = arr::<String>(input(ins, 0)?)?;
    let full = full_match_pattern(ctx)?;
    let re = regex::Regex::new(&full)
        .map_err(|e| OpError::new(format!("RegexFullMatch: invalid pattern {full:?}: {e}")))?;
    out(Tensor::from_array(x.map(|s| re.is_match(s))))
}

/// A deterministic automaton as tables: states are numbered from 0, bytes map to classes
/// (bytes of one class move every state alike), and `next[s * classes + c]` is the state
/// after a byte of class `c` in state `s`.
#[derive(Debug)]
pub(crate) struct Automaton {
    pub class: [u8; 256],
    pub classes: usize,
    pub next: Vec<u32>,
    /// Whether the input matches when it ends in this state.
    pub accept: Vec<bool>,
    pub start: u32,
    /// The state from which nothing matches, if there is one.
    pub dead: Option<u32>,
}

/// Bytes of transition table an automaton may have.
const MAX_AUTOMATON_BYTES: usize = 8 << 20;

/// The full-match automaton of an anchored pattern (`^(?:...)$`): a dense DFA from
/// `regex-automata` (all matches, anchored start), renumbered over the states reachable
/// from the start, with the answer at the end of input folded into `accept`.
pub(crate) fn full_match_automaton(full: &str) -> Result<Automaton, String> {
    use regex_automata::dfa::{dense, Automaton as _, StartKind};
    use regex_automata::util::start;
    use regex_automata::{Anchored, MatchKind};
    let dfa = dense::Builder::new()
        .configure(
            dense::Config::new()
                .match_kind(MatchKind::All)
                .start_kind(StartKind::Anchored)
                .dfa_size_limit(Some(4 * MAX_AUTOMATON_BYTES))
                .determinize_size_limit(Some(4 * MAX_AUTOMATON_BYTES)),
        )
        .build(full)
        .map_err(|e| format!("no deterministic automaton for {full:?}: {e}"))?;
    let s0 = dfa
        .start_state(&start::Config::new().anchored(Anchored::Yes))
        .map_err(|e| format!("no start state: {e}"))?;
    let bc = dfa.byte_classes();
    let mut class = [0u8; 256];
    let mut rep: Vec<u8> = Vec::new();
    for b in 0..=255u8 {
        let c = bc.get(b);
        class[b as usize] = c;
        if rep.len() <= c as usize {
            rep.resize(c as usize + 1, b);
            rep[c as usize] = b;
        }
    }
    // Class ids are dense from 0 in byte order, so `rep` holds one byte of each.
    let classes = rep.len();
    let mut ids = std::collections::HashMap::new();
    let mut order = vec![s0];
    ids.insert(s0, 0u32);
    let mut next: Vec<u32> = Vec::new();
    let mut accept = Vec::new();
    let mut dead = None;
    let mut k = 0;
    while k < order.len() {
        let s = order[k];
        if dfa.is_dead_state(s) {
            dead = Some(k as u32);
        }
        accept.push(dfa.is_match_state(dfa.next_eoi_state(s)));
        for &b in &rep {
            let t = dfa.next_state(s, b);
            if dfa.is_quit_state(t) {
                return Err(format!("the automaton of {full:?} gives up on some input"));
            }
            let id = *ids.entry(t).or_insert_with(|| {
                order.push(t);
                (order.len() - 1) as u32
            });
            next.push(id);
        }
        if next.len() * 4 > MAX_AUTOMATON_BYTES {
            return Err(format!(
                "the automaton of {full:?} needs more than {} MiB of tables",
                MAX_AUTOMATON_BYTES >> 20
            ));
        }
        k += 1;
    }
    Ok(Automaton {
        class,
        classes,
        next,
        accept,
        start: 0,
        dead,
    })
}

#[cfg(test)]
impl Automaton {
    /// Whether `s` is accepted (walked as compiled code walks it; for tests).
    pub fn full_match(&self, s: &[u8]) -> bool {
        let mut q = self.start;
        for &b in s {
            if Some(q) == self.dead {
                return false;
            }
            q = self.next[q as usize * self.classes + self.class[b as usize] as usize];
        }
        self.accept[q as usize]
    }
}

mod lower {
    use crate::ir::{OpError, OpResult, Tensor};
    use crate::kir::{BinOp, CmpOp, Expr, Stmt, Ty};
    use crate::ops::lowering::LowerCtx;
    use crate::ops::{Lowering, Registry};

    /// RegexFullMatch: per string, the automaton's state is walked byte by byte through
    /// its tables (class of the byte, then the next state), stopping at the NUL or in the
    /// dead state; the output is whether the last state accepts.
    fn regex_full_match(lw: &mut LowerCtx) -> OpResult<()> {
        let full = super::full_match_pattern(lw.op)?;
        let a = super::full_match_automaton(&full)
            .map_err(|e| OpError::unsupported(format!("RegexFullMatch: {e}")))?;
        let x = lw.input(0)?.clone();
        let out = lw.outputs[0].clone();
        if out.is_empty() {
            return Ok(());
        }
        let class = lw.constant("class", &Tensor::from_vec(&[256], a.class.to_vec()))?;
        let n = a.next.len();
        let next = if a.accept.len() <= 1 << 16 {
            let v: Vec<u16> = a.next.iter().map(|&s| s as u16).collect();
            lw.constant("next", &Tensor::from_vec(&[n], v))?
        } else {
            lw.constant("next", &Tensor::from_vec(&[n], a.next.clone()))?
        };
        let accept: Vec<u8> = a.accept.iter().map(|&b| b as u8).collect();
        let accept = lw.constant("accept", &Tensor::from_vec(&[accept.len()], accept))?;
        let mut k = lw.kernel("");
        let (i, j, s) = (k.var(Ty::I64), k.var(Ty::I64), k.var(Ty::I64));
        let byte = Expr::str_byte(x.buf, Expr::Var(i), Expr::Var(j));
        let mut cond = Expr::cmp(CmpOp::Ne, byte.clone(), Expr::cast(Ty::U8, Expr::Int(0)));
        if let Some(d) = a.dead {
            cond = Expr::bin(
                BinOp::And,
                cond,
                Expr::cmp(CmpOp::Ne, Expr::Var(s), Expr::Int(d as i64)),
            );
        }
        let c = Expr::cast(Ty::I64, Expr::load(class, Expr::cast(Ty::I64, byte)));
        let at = Expr::add(Expr::mul(Expr::Var(s), Expr::Int(a.classes as i64)), c);
        k.body = vec![Stmt::For {
            var: i,
            extent: out.len() as u64,
            body: vec![
                Stmt::Set {
                    var: s,
                    value: Expr::Int(a.start as i64),
                },
                Stmt::Set {
                    var: j,
                    value: Expr::Int(0),
                },
                Stmt::While {
                    cond,
                    body: vec![
                        Stmt::Set {
                            var: s,
                            value: Expr::cast(Ty::I64, Expr::load(next, at)),
                        },
                        Stmt::Set {
                            var: j,
                            value: Expr::add(Expr::Var(j), Expr::Int(1)),
                        },
                    ],
                },
                Stmt::Store {
                    buf: out.buf,
                    index: Expr::Var(i),
                    value: Expr::load(accept, Expr::Var(s)),
                },
            ],
        }];
        lw.push(k);
        Ok(())
    }

    /// StringConcat makes new strings: refused, with the reason.
    fn string_concat(_: &mut LowerCtx) -> OpResult<()> {
        Err(OpError::unsupported(
            "StringConcat makes new strings whose lengths depend on the input data, and \
             compiled code allocates nothing to hold them (it can only pass existing \
             strings along); concatenate before or after the model",
        ))
    }

    pub fn register(r: &mut Registry) {
        r.lower("RegexFullMatch", Lowering::Custom(regex_full_match));
        r.lower("StringConcat", Lowering::Custom(string_concat));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perl_classes_and_word_boundaries_become_ascii() {
        for (pat, want) in [
            (r"\w+", "[0-9A-Za-z_]+"),
            (r"[\w.-]+\.\bcom\b", r"[0-9A-Za-z_.-]+\.(?-u:\b)com(?-u:\b)"),
            (r"\D\S", r"[^0-9][^\t\n\f\r\x20]"),
            (r"[^\W\d]", "[^[^0-9A-Za-z_]0-9]"),
            (r"\\w\B", r"\\w(?-u:\B)"),
            (r"(\W|^)a$", "([^0-9A-Za-z_]|^)a$"),
        ] {
            assert_eq!(re2_pattern(pat).unwrap(), want, "{pat}");
        }
        assert!(re2_pattern("(unclosed").is_err());
    }

    #[test]
    fn the_automaton_matches_what_the_regex_crate_matches() {
        let pats = [
            r"www\.[\w.-]+\.\bcom\b",
            r"(\W|^)[\w.\-]{0,25}@(yahoo|gmail)\.com(\W|$)",
            "",
            "a*",
            "a|ab|abc",
            r"\d{2,3}-\s?x",
            ".é.",
            "(?i)straSSe|ÄÖ",
            r"[^a-c]+\b",
            r"\pL+\d",
        ];
        let words = [
            "",
            "a",
            "ab",
            "abc",
            "abcd",
            "www.google.com",
            "www.bbc.co.uk",
            "www.a-b.com",
            "account@gmail.com",
            " x@yahoo.com!",
            "not email",
            "12-x",
            "123- x",
            "1234-x",
            "xéy",
            "éé",
            "xéyz",
            "strasse",
            "STRASSE",
            "äö",
            "ÄÖ",
            "ddd ",
            "déf1",
            "日本2",
            "é1",
            "\u{7f}",
            "\u{10ffff}",
        ];
        for p in pats {
            let full = format!("^(?:{})$", re2_pattern(p).unwrap());
            let re = regex::Regex::new(&full).unwrap();
            let a = full_match_automaton(&full).unwrap();
            for w in words {
                assert_eq!(
                    a.full_match(w.as_bytes()),
                    re.is_match(w),
                    "pattern {p:?} on {w:?}"
                );
            }
        }
    }

    #[test]
    fn unicode_word_characters_are_not_re2_word_characters() {
        let full = format!("^(?:{})$", re2_pattern(r"\w+").unwrap());
        let a = full_match_automaton(&full).unwrap();
        assert!(a.full_match(b"abc_9"));
        assert!(!a.full_match("é".as_bytes()));
    }
}
