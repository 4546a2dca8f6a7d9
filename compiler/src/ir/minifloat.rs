//! 8-bit and 4-bit float formats of ONNX (float8e4m3fn, float8e4m3fnuz, float8e5m2,
//! float8e5m2fnuz, float4e2m1, float8e8m0): decoding and round-to-nearest-even encoding
//! with ONNX's saturation rules (the table in the `Cast` operator's documentation).

use super::DType;

#[derive(Clone, Copy)]
struct Format {
    exp: u32,
    man: u32,
    bias: i32,
    /// NaN is the single code 0x80 and there is no negative zero.
    uz: bool,
    /// IEEE-style: all-ones exponent holds inf (mantissa 0) and NaN.
    ieee: bool,
    /// E4M3FN: only S.1111.111 is NaN.
    fn_nan: bool,
}

fn format(dt: DType) -> Format {
    match dt {
        DType::F8E4M3FN => Format {
            exp: 4,
            man: 3,
            bias: 7,
            uz: false,
            ieee: false,
            fn_nan: true,
        },
        DType::F8E4M3FNUZ => Format {
            exp: 4,
            man: 3,
            bias: 8,
            uz: true,
            ieee: false,
            fn_nan: false,
        },
        DType::F8E5M2 => Format {
            exp: 5,
            man: 2,
            bias: 15,
            uz: false,
            ieee: true,
            fn_nan: false,
        },
        DType::F8E5M2FNUZ => Format {
            exp: 5,
            man: 2,
            bias: 16,
            uz: true,
            ieee: false,
            fn_nan: false,
        },
        DType::F4E2M1 => Format {
            exp: 2,
            man: 1,
            bias: 1,
            uz: false,
            ieee: false,
            fn_nan: false,
        },
        _ => panic!("{dt} is not a minifloat format"),
    }
}

/// Decodes one element of a minifloat dtype to f64.
pub fn decode(dt: DType, bits: u8) -> f64 {
    if dt == DType::F8E8M0 {
        return if bits == 0xFF {
            f64::NAN
        } else {
            2f64.powi(bits as i32 - 127)
        };
    }
    let f = format(dt);
    let width = 1 + f.exp + f.man;
    let bits = bits as u32 & ((1 << width) - 1);
    let sign_bit = 1 << (width - 1);
    if f.uz && bits == sign_bit {
        return f64::NAN;
    }
    let neg = bits & sign_bit != 0;
    let e = (bits >> f.man) & ((1 << f.exp) - 1);
    let m = bits & ((1 << f.man) - 1);
    let emax = (1 << f.exp) - 1;
    if f.ieee && e == emax {
        let v = if m == 0 { f64::INFINITY } else { f64::NAN };
        return if neg { -v } else { v };
    }
    if f.fn_nan && e == emax && m == (1 << f.man) - 1 {
        return f64::NAN;
    }
    let v = if e == 0 {
        m as f64 * 2f64.powi(1 - f.bias - f.man as i32)
    } else {
        (1.0 + m as f64 / (1u32 << f.man) as f64) * 2f64.powi(e as i32 - f.bias)
    };
    if neg {
        -v
    } else {
        v
    }
}

/// Largest finite value and its code.
fn max_finite(dt: DType) -> (f64, u8) {
    let f = format(dt);
    let width = 1 + f.exp + f.man;
    let top = (1u32 << (width - 1)) - 1; // all ones but the sign
    let mut code = top;
    loop {
        let v = decode(dt, code as u8);
        if v.is_finite() {
            return (v, code as u8);
        }
        code -= 1;
    }
}

/// Encodes `x` with round-to-nearest-even. With `saturate`, values beyond the largest
/// finite value, infinities included, become it, as ONNX's reference does.
pub fn encode(dt: DType, x: f64, saturate: bool) -> u8 {
    if dt == DType::F8E8M0 {
        return encode_e8m0(x, saturate);
    }
    let f = format(dt);
    let width = 1 + f.exp + f.man;
    let sign_bit: u8 = 1 << (width - 1);
    let nan_code: u8 = if f.uz {
        sign_bit
    } else if f.ieee || f.fn_nan {
        // E5M2: all-ones exponent, non-zero mantissa; E4M3FN: all-ones exponent and
        // mantissa (both the same code with the sign clear).
        ((1u32 << (f.exp + f.man)) - 1) as u8
    } else {
        // float4e2m1 has no NaN: map it to the largest value as ONNX's reference does.
        max_finite(dt).1
    };
    let neg_flag = |code: u8, neg: bool| -> u8 {
        if neg && !(f.uz && code == 0) {
            code | sign_bit
        } else {
            code
        }
    };
    if x.is_nan() {
        if dt == DType::F4E2M1 {
            // No NaN in float4e2m1; ml_dtypes (ONNX's reference) gives -0 for +NaN.
            return if x.is_sign_negative() { 0 } else { 0x8 };
        }
        return nan_code;
    }
    let neg = x.is_sign_negative();
    let a = x.abs();
    let (max, max_code) = max_finite(dt);
    let overflow = |neg: bool| -> u8 {
        if saturate || !(f.ieee || f.fn_nan || f.uz) {
            neg_flag(max_code, neg)
        } else if f.ieee {
            neg_flag((((1u32 << f.exp) - 1) << f.man) as u8, neg)
        } else {
            nan_code
        }
    };
    if a.is_infinite() {
        return overflow(neg);
    }
    // Walk the positive codes in value order (codes are monotonic in value).
    let mut prev = (0.0f64, 0u8);
    for code in 1..=max_code {
        let v = decode(dt, code);
        if a < v {
            let mid = (prev.0 + v) / 2.0;
            let pick = if a < mid {
                prev.1
            } else if a > mid {
                code
            } else if prev.1.is_multiple_of(2) {
                prev.1
            } else {
                code
            };
            return neg_flag(pick, neg);
        }
        if a == v {
            return neg_flag(code, neg);
        }
        prev = (v, code);
    }
    // Beyond the largest finite value: it rounds down to max below half a step past it.
    let step = max - decode(dt, max_code - 1);
    let mid = max + step / 2.0;
    if a < mid || (a == mid && max_code % 2 == 0) {
        neg_flag(max_code, neg)
    } else {
        overflow(neg)
    }
}

fn encode_e8m0(x: f64, saturate: bool) -> u8 {
    // ONNX's default round mode for E8M0 is "up": the smallest power of two >= x.
    if x.is_nan() || x < 0.0 {
        return 0xFF;
    }
    if x == 0.0 {
        return 0;
    }
    if x.is_infinite() {
        return if saturate { 0xFE } else { 0xFF };
    }
    let e = x.log2().ceil() as i64 + 127;
    if e > 254 {
        if saturate {
            0xFE
        } else {
            0xFF
        }
    } else {
        e.max(0) as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_all_codes() {
        for dt in [
            DType::F8E4M3FN,
            DType::F8E4M3FNUZ,
            DType::F8E5M2,
            DType::F8E5M2FNUZ,
        ] {
            for code in 0..=255u8 {
                let v = decode(dt, code);
                if v.is_nan() {
                    continue;
                }
                let back = encode(dt, v, false);
                assert_eq!(decode(dt, back), v, "{dt} code {code:#x}");
            }
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(max_finite(DType::F8E4M3FN).0, 448.0);
        assert_eq!(max_finite(DType::F8E4M3FNUZ).0, 240.0);
        assert_eq!(max_finite(DType::F8E5M2).0, 57344.0);
        assert_eq!(max_finite(DType::F4E2M1).0, 6.0);
        assert_eq!(
            decode(DType::F8E5M2, encode(DType::F8E5M2, 1e6, false)),
            f64::INFINITY
        );
        assert_eq!(
            decode(DType::F8E4M3FN, encode(DType::F8E4M3FN, 1e6, true)),
            448.0
        );
        assert!(decode(DType::F8E4M3FN, encode(DType::F8E4M3FN, 1e6, false)).is_nan());
        assert_eq!(decode(DType::F4E2M1, encode(DType::F4E2M1, 2.5, true)), 2.0);
    }
}
