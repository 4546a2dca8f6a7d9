/* Classifies an 8x8 handwritten digit with the model onnxc compiled into digits.o.
 *   digits IMAGE.bin   (64 little-endian floats in [0, 1], row by row) */
#include <stdio.h>
#include <stdlib.h>
#include "digits.h"

/* The scratch memory the model needs: static, so the program allocates nothing. */
static unsigned char arena[DIGITS_ARENA_BYTES + 1] __attribute__((aligned(DIGITS_ARENA_ALIGN)));

int main(int argc, char **argv) {
    float image[DIGITS_INPUT_0_ELEMS];
    float logits[DIGITS_OUTPUT_0_ELEMS];
    if (argc != 2) {
        fprintf(stderr, "usage: %s IMAGE.bin\n", argv[0]);
        return 2;
    }
    if (!digits_cpu_supported()) {
        fprintf(stderr, "this CPU lacks instructions the model was compiled for; rebuild with --target host\n");
        return 3;
    }
    FILE *f = fopen(argv[1], "rb");
    if (!f || fread(image, sizeof image, 1, f) != 1) {
        fprintf(stderr, "cannot read %d floats from %s\n", DIGITS_INPUT_0_ELEMS, argv[1]);
        return 2;
    }
    fclose(f);
    int32_t status = digits_run(image, logits, arena);
    if (status != ONNXC_OK) {
        fprintf(stderr, "digits_run: %s\n", onnxc_status_str(status));
        return 1;
    }
    int best = 0;
    for (int i = 1; i < DIGITS_OUTPUT_0_ELEMS; i++)
        if (logits[i] > logits[best]) best = i;
    printf("predicted digit: %d   logits:", best);
    for (int i = 0; i < DIGITS_OUTPUT_0_ELEMS; i++) printf(" %.2f", logits[i]);
    printf("\n");
    return 0;
}
