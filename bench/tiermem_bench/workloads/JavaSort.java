// The JDK's own library code on a heap the JVM maps with MAP_FIXED: Arrays.sort (dual-pivot
// quicksort) over random longs, then a HashMap of boxed counts built from every eighth (objects the
// collector copies and frees). Prints the harness's result line with a digest of the sorted
// array and the counts.
import java.util.HashMap;
import java.util.Locale;
import java.util.Map;

public class JavaSort {
    public static void main(String[] args) {
        int n = Integer.parseInt(args[0]);
        int groups = Integer.parseInt(args[1]);
        long seed = Long.parseLong(args[2]);
        long start = System.nanoTime();
        long[] keys = new long[n];
        long x = 0x9E3779B97F4A7C15L ^ seed;
        for (int i = 0; i < n; i++) {
            x ^= x << 13; x ^= x >>> 7; x ^= x << 17;
            keys[i] = x;
        }
        java.util.Arrays.sort(keys);
        Map<Long, Long> counts = new HashMap<>();
        for (int i = 0; i < n; i += 8) counts.merge(Math.floorMod(keys[i], (long) groups), 1L, Long::sum);
        long h = 0xcbf29ce484222325L;
        for (int i = 0; i < n; i += 97) h = (h ^ keys[i]) * 0x100000001b3L;
        long spread = 0;
        for (long g = 0; g < groups; g++) spread += counts.getOrDefault(g, 0L) * (g + 1);
        double seconds = (System.nanoTime() - start) / 1e9;
        System.out.printf(Locale.ROOT, "TIERMEM_BENCH_RESULT {\"digest\": \"%016x-%d-%d-%d\", \"n\": %d, \"work_s\": %.6f}%n",
                h, spread, n, seed, n, seconds);
    }
}
