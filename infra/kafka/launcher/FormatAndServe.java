// The local broker's main class: formats the log dir where it has not been formatted yet, then runs the
// broker, in one JVM. Formatting in a JVM of its own cost a second JVM start per stack: about 2 s of wall
// time and 3 s of CPU on 2 cores, and the test suite starts about twenty brokers (mars_stack.kafka.prepare).
//
// Arguments: the log dir's meta.properties, the file that holds StorageTool's format arguments one per line
// (deleted once read: it holds the SCRAM passwords), and the broker's server.properties.
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.List;

public final class FormatAndServe {
    private FormatAndServe() {}

    public static void main(String[] args) throws Exception {
        if (args.length != 3) {
            System.err.println("usage: FormatAndServe <meta.properties> <format-args file> <server.properties>");
            System.exit(2);
        }
        Path meta = Paths.get(args[0]);
        Path formatArgs = Paths.get(args[1]);
        if (!Files.exists(meta)) {
            List<String> format = Files.readAllLines(formatArgs);
            Files.deleteIfExists(formatArgs);
            int status;
            try {
                status = kafka.tools.StorageTool.execute(format.toArray(new String[0]), System.out);
            } catch (Exception e) {
                System.err.println("formatting the Kafka log dir failed: " + e);
                status = 1;
            }
            if (status != 0) {
                System.err.println("formatting the Kafka log dir failed with status " + status);
                System.exit(status);
            }
        } else {
            Files.deleteIfExists(formatArgs);
        }
        kafka.Kafka.main(new String[] {args[2]});
    }
}
