//! The random number generator shared by Dropout (training) and the random ops.

/// NumPy's legacy MT19937 generator (`np.random.RandomState(seed)`), with its legacy
/// uniform, Gaussian and n=1 binomial draws, so seeded random ops reproduce NumPy.
pub(crate) struct Mt {
    s: [u32; 624],
    i: usize,
    gauss: Option<f64>,
}

impl Mt {
    pub(crate) fn new(seed: u32) -> Mt {
        let mut s = [0u32; 624];
        s[0] = seed;
        for i in 1..624 {
            s[i] = 1812433253u32
                .wrapping_mul(s[i - 1] ^ (s[i - 1] >> 30))
                .wrapping_add(i as u32);
        }
        Mt {
            s,
            i: 624,
            gauss: None,
        }
    }

    pub(crate) fn next_u32(&mut self) -> u32 {
        if self.i >= 624 {
            for k in 0..624 {
                let y = (self.s[k] & 0x8000_0000) | (self.s[(k + 1) % 624] & 0x7fff_ffff);
                let mut v = self.s[(k + 397) % 624] ^ (y >> 1);
                if y & 1 != 0 {
                    v ^= 0x9908_b0df;
                }
                self.s[k] = v;
            }
            self.i = 0;
        }
        let mut y = self.s[self.i];
        self.i += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }

    pub(crate) fn uniform(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67108864.0 + b) / 9007199254740992.0
    }

    /// `legacy_gauss`: the polar Box-Muller method, caching the second value.
    pub(crate) fn gauss(&mut self) -> f64 {
        if let Some(g) = self.gauss.take() {
            return g;
        }
        loop {
            let x1 = 2.0 * self.uniform() - 1.0;
            let x2 = 2.0 * self.uniform() - 1.0;
            let r2 = x1 * x1 + x2 * x2;
            if r2 < 1.0 && r2 != 0.0 {
                let f = (-2.0 * r2.ln() / r2).sqrt();
                self.gauss = Some(f * x1);
                return f * x2;
            }
        }
    }

    /// `legacy_random_binomial` with n = 1 (the inversion algorithm).
    pub(crate) fn bernoulli(&mut self, p: f64) -> f64 {
        let u = self.uniform();
        if p <= 0.5 {
            let qn = (1.0 - p).ln().exp();
            (u > qn) as u8 as f64
        } else {
            let q = 1.0 - p;
            let qn = (1.0 - q).ln().exp();
            1.0 - (u > qn) as u8 as f64
        }
    }
}
