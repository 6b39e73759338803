"""The calibration texts of fp8_rounding "gptq" (plan/fp8_calibrate.py): short passages of prose, dialogue, code,
data and lists written for this project, each one calibration sequence. Not the evaluation prompts of
scripts/fp8_accuracy.py: accuracy is never measured on these."""
from __future__ import annotations

import hashlib

TEXTS = (
    "The river town woke slowly that autumn. Fog lay on the water until almost nine, and the ferryman waited "
    "with his hands in his pockets, listening for the bell of the first customer. Across the square the baker had "
    "already sold out of rye, and the schoolteacher, who never ate breakfast, was arguing with the postman about "
    "whether the new bridge would ever be finished. Nobody in town believed the council's promises any more; they "
    "had heard the same speech every spring for eleven years. Still, the surveyors had come back in August, and "
    "a crane now stood on the far bank like a patient heron.",

    "User: My tomato plants have yellow leaves at the bottom. What am I doing wrong?\n"
    "Assistant: Yellowing of the lowest leaves is common and often harmless: older leaves are shaded and the plant "
    "moves nitrogen away from them. If it spreads upward quickly, check three things. First, watering: soil that "
    "stays soggy suffocates roots, so water deeply but let the top few centimetres dry out. Second, feeding: a "
    "balanced fertiliser every two weeks helps plants that are setting fruit. Third, disease: brown spots with "
    "rings suggest early blight, and those leaves should be removed and thrown away, not composted.\n"
    "User: Thanks! Should I prune the suckers too?",

    "def merge_intervals(intervals):\n"
    "    \"\"\"Merge overlapping [start, end] pairs and return them sorted.\"\"\"\n"
    "    result = []\n"
    "    for start, end in sorted(intervals):\n"
    "        if result and start <= result[-1][1]:\n"
    "            result[-1][1] = max(result[-1][1], end)\n"
    "        else:\n"
    "            result.append([start, end])\n"
    "    return result\n\n\n"
    "class LRUCache:\n"
    "    def __init__(self, capacity: int):\n"
    "        self.capacity = capacity\n"
    "        self.items = {}\n\n"
    "    def get(self, key):\n"
    "        if key not in self.items:\n"
    "            return None\n"
    "        value = self.items.pop(key)\n"
    "        self.items[key] = value\n"
    "        return value\n\n"
    "    def put(self, key, value):\n"
    "        self.items.pop(key, None)\n"
    "        if len(self.items) >= self.capacity:\n"
    "            self.items.pop(next(iter(self.items)))\n"
    "        self.items[key] = value\n",

    "Glaciers move because ice, under enough pressure, behaves like an extremely slow fluid. Snow that survives the "
    "summer is buried by the next winter's snow, compacted into firn and finally into dense blue ice. Once the ice "
    "is thicker than about fifty metres, its own weight makes the lower layers deform and flow downhill, while the "
    "brittle surface cracks into crevasses. Meltwater reaching the bed can lubricate it and speed the glacier up "
    "for days at a time. Scientists measure this motion with stakes, GPS receivers and satellite radar, and the "
    "records show that many mountain glaciers have retreated by hundreds of metres since the middle of the last "
    "century.",

    "Quarterly summary\n\n| Region | Revenue (M) | Change | Staff |\n|---|---|---|---|\n"
    "| North | 12.4 | +3.1% | 210 |\n| South | 9.8 | -0.7% | 185 |\n| East | 15.2 | +6.4% | 264 |\n"
    "| West | 7.1 | +1.9% | 122 |\n\nTotal revenue rose to 44.5 million, up 2.9% on the previous quarter. The East "
    "region grew fastest after two new stores opened in March; the South was held back by the closure of its "
    "largest warehouse for repairs between 4 and 27 February. Costs per employee fell by 1.2%.",

    "How to change a bicycle inner tube:\n1. Shift to the smallest rear cog and open the brake if it is a rim "
    "brake.\n2. Release the quick-release lever or loosen the axle nuts and take the wheel out.\n3. Let out any "
    "remaining air, then push the valve up into the tyre.\n4. Hook two tyre levers under the bead about ten "
    "centimetres apart and lever one side of the tyre off the rim.\n5. Pull out the old tube and run your fingers "
    "carefully around the inside of the tyre to find the thorn or glass that caused the puncture.\n6. Put a "
    "little air in the new tube so it holds its shape, insert the valve, tuck the tube in and roll the bead back "
    "on with your thumbs.\n7. Inflate to the pressure printed on the sidewall.",

    "SELECT c.customer_id, c.name, SUM(o.total) AS lifetime_value\nFROM customers AS c\nJOIN orders AS o ON "
    "o.customer_id = c.customer_id\nWHERE o.status = 'shipped' AND o.created_at >= DATE '2023-01-01'\nGROUP BY "
    "c.customer_id, c.name\nHAVING SUM(o.total) > 1000\nORDER BY lifetime_value DESC\nLIMIT 20;\n\n-- The index on "
    "orders(customer_id, status, created_at) lets the planner avoid a full scan; without it the query reads every "
    "order row before filtering.",

    "In a market economy, prices carry information. When a frost destroys part of the coffee harvest, the price of "
    "coffee rises long before most drinkers have heard about the weather in Brazil. Roasters buy less, cafes "
    "raise their prices a little, and some customers switch to tea. Growers elsewhere, seeing the higher price, "
    "plant more trees, although those trees will take three or four years to bear fruit. Economists argue about how "
    "well this mechanism works when markets are concentrated or when buyers cannot see the quality of what they "
    "buy, but few deny that it coordinates millions of decisions that no planner could collect.",

    "const express = require('express');\nconst app = express();\napp.use(express.json());\n\nconst todos = new "
    "Map();\nlet nextId = 1;\n\napp.post('/todos', (req, res) => {\n  const { title } = req.body;\n  if (typeof "
    "title !== 'string' || title.length === 0) {\n    return res.status(400).json({ error: 'title is required' });\n"
    "  }\n  const todo = { id: nextId++, title, done: false };\n  todos.set(todo.id, todo);\n  res.status(201)"
    ".json(todo);\n});\n\napp.get('/todos/:id', (req, res) => {\n  const todo = todos.get(Number(req.params.id));\n"
    "  todo ? res.json(todo) : res.status(404).end();\n});\n\napp.listen(3000);",

    "The committee met on Tuesday to review the proposal for a community library in the old railway station. The "
    "architect explained that the building's iron roof could be kept and insulated, and that the platforms would "
    "become a reading garden. Several members worried about the cost of heating such a tall hall in winter. The "
    "treasurer reported that a regional fund would cover forty per cent of the construction if the town raised "
    "the rest by June. After a long discussion the committee voted seven to two to apply for the grant and to hold "
    "a public meeting next month.",

    "Dear Ms. Okafor,\n\nThank you for your letter of 14 March about the delayed delivery of your sofa. I am sorry "
    "that you waited at home on two separate days without anyone arriving. Our records show that the first "
    "appointment was cancelled because the vehicle broke down, and that the second was never confirmed with the "
    "driver. This is not the service we aim to give. We have refunded the delivery charge of 49 euros and booked "
    "a new slot for Friday morning between eight and ten, with a call thirty minutes before arrival.\n\nYours "
    "sincerely,\nDaniel Moreau\nCustomer Care",

    "A matrix A is invertible exactly when its determinant is nonzero, which is equivalent to saying that the "
    "equation Ax = 0 has only the trivial solution. For a symmetric positive definite matrix there is a cheaper "
    "test: the Cholesky factorisation A = L L^T exists, with L lower triangular and a positive diagonal. Solving "
    "Ax = b then takes two triangular solves, Ly = b followed by L^T x = y, each of cost proportional to n^2. "
    "Because 2 + 2 = 4 and 3 * 7 = 21 are facts no factorisation can change, numerical analysts care instead about "
    "conditioning: a condition number of 10^8 can cost eight digits of accuracy in the answer.",

    "Le marche du samedi commence tres tot. Les maraichers installent leurs tables avant le lever du jour, et vers "
    "huit heures la place est pleine de paniers, de fromages et de fleurs. Wer am Sonntag in die Berge fahren will, "
    "sollte den ersten Zug nehmen, denn spaeter sind die Wagen voll. El tren sale a las siete y cuarto y llega a "
    "la estacion del valle poco despues de las nueve. Many travellers mix these languages in a single afternoon "
    "without noticing.",

    "#include <stdio.h>\n#include <stdlib.h>\n\ntypedef struct node {\n    int value;\n    struct node *next;\n} "
    "node;\n\nnode *push(node *head, int value) {\n    node *n = malloc(sizeof *n);\n    if (!n) {\n        "
    "perror(\"malloc\");\n        exit(1);\n    }\n    n->value = value;\n    n->next = head;\n    return n;\n}\n\n"
    "int main(void) {\n    node *list = NULL;\n    for (int i = 0; i < 10; i++)\n        list = push(list, i * "
    "i);\n    for (node *p = list; p; p = p->next)\n        printf(\"%d \", p->value);\n    putchar('\\n');\n    "
    "return 0;\n}",

    "Question: A train leaves at 14:20 and arrives at 17:05. How long is the journey?\nAnswer: From 14:20 to 17:20 "
    "is three hours; 17:05 is fifteen minutes earlier, so the journey takes 2 hours and 45 minutes.\n\nQuestion: "
    "A shop sells pens at 3 for 2.40. How much do 7 pens cost?\nAnswer: One pen costs 0.80, so seven cost 5.60.\n\n"
    "Question: If a rectangle has a perimeter of 30 cm and one side of 6 cm, what is its area?\nAnswer: The other "
    "side is (30 - 2 * 6) / 2 = 9 cm, so the area is 54 square centimetres.",

    "The museum's newest room is dedicated to navigation before satellites. Visitors first see a replica of a "
    "Polynesian stick chart, whose curved ribs map the way ocean swells bend around islands. Next come brass "
    "astrolabes, a cross-staff and a marine chronometer whose accuracy finally allowed sailors to fix their "
    "longitude at sea. The final case holds a well-worn notebook from a 1950s freighter, filled with star sights, "
    "dead-reckoning positions and a note in the margin: fog again, sounded twelve fathoms, proceeding slowly.",
    "The orchestra tuned for almost ten minutes, because the hall was cold and the strings kept slipping. When the "
    "conductor finally raised her baton, the first chord of the symphony came out thin and uncertain, but by the "
    "second movement the players had warmed up and the cellos carried the slow melody with real confidence. In the "
    "interval people queued for coffee and argued about the tempo: some thought the finale would be rushed, others "
    "that the soloist had been too cautious in the cadenza. Nobody left early.",

    "Installing the command-line tool\n\nRequirements: Python 3.10 or newer and a C compiler.\n\n    $ python -m venv "
    ".venv\n    $ source .venv/bin/activate\n    $ pip install --upgrade pip\n    $ pip install mytool\n    $ "
    "mytool --version\n    mytool 2.4.1\n\nIf the last command prints 'command not found', the virtual environment "
    "is not active. On Windows use .venv\\Scripts\\activate instead. Configuration lives in ~/.config/mytool/"
    "config.toml; run `mytool init` to write a default file, then edit the [storage] section to point at your data "
    "directory.",

    "Vaccines train the immune system without causing the disease. Some contain a weakened or inactivated form of "
    "a virus, others only a single protein from its surface, and the newer messenger RNA vaccines carry "
    "instructions that let our own cells make that protein for a short time. In each case the body produces "
    "antibodies and memory cells. If the real pathogen arrives later, those memory cells recognise it and respond "
    "within days instead of weeks. Because protection from some vaccines fades, booster doses are recommended at "
    "intervals that depend on the disease and on a person's age.",

    "User: Can you explain the difference between TCP and UDP in simple terms?\nAssistant: Think of TCP as a "
    "registered letter and UDP as a postcard. TCP sets up a connection first, numbers every piece of data, and "
    "resends anything that gets lost, so the receiver gets everything in the right order. That reliability costs "
    "time. UDP just sends packets and hopes for the best: no handshake, no resending. It is used where speed "
    "matters more than perfection, such as video calls, online games and DNS lookups.\nUser: So why does "
    "streaming video often use TCP?",

    "fn parse_line(line: &str) -> Option<(String, u32)> {\n    let mut parts = line.splitn(2, ',');\n    let name = "
    "parts.next()?.trim().to_string();\n    let age = parts.next()?.trim().parse().ok()?;\n    Some((name, age))\n}"
    "\n\nfn main() {\n    let input = \"alice, 31\\nbob, x\\ncarol, 27\";\n    let people: Vec<_> = input.lines()"
    ".filter_map(parse_line).collect();\n    for (name, age) in &people {\n        println!(\"{name} is {age}\");\n"
    "    }\n    assert_eq!(people.len(), 2);\n}",

    "Weather report for the weekend. Saturday starts dry with sunny spells, but cloud thickens from the west during "
    "the afternoon and rain reaches the coast by evening. Highs of 14 to 17 degrees, with a moderate south-westerly "
    "wind, strong on exposed hills. Sunday is wet and windy at first; the rain clears eastwards around midday, "
    "leaving bright, showery weather with a risk of hail and thunder in the north. Temperatures a little lower, "
    "12 to 15 degrees. Overnight frost is possible in sheltered valleys.",

    "The first rule of our kitchen was that nothing went to waste. Stale bread became crumbs for the schnitzel or "
    "was soaked in milk and eggs for a sweet pudding; the outer leaves of the cabbage went into soup; bones were "
    "roasted and simmered for a whole afternoon. My grandmother measured nothing. She added salt by the pinch and "
    "flour until the dough felt right, and when I asked her to write the recipes down she laughed and said that "
    "a recipe was only a rumour about a meal.",

    "Minutes of the sprint review, 9 October\nAttendees: Priya (product), Tom, Lena, Jorge (engineering), Mei (QA)"
    "\n- Search filters shipped to 10% of users; error rate unchanged at 0.3%.\n- The export job still times out "
    "for accounts with more than 50,000 records. Jorge will split it into batches of 5,000 and add a progress bar."
    "\n- Mei found two accessibility issues in the settings page (missing labels on toggles). Fix planned for next "
    "sprint.\n- Decision: postpone the dark theme until the design system update lands.\nNext review: 23 October.",

    "import pandas as pd\n\ndf = pd.read_csv('sales.csv', parse_dates=['date'])\ndf['month'] = df['date'].dt.to_"
    "period('M')\nmonthly = (df.groupby(['month', 'region'])['amount']\n           .sum()\n           .unstack("
    "fill_value=0))\nprint(monthly.tail())\ngrowth = monthly.pct_change().mul(100).round(1)\nbest = growth.iloc[-1]"
    ".idxmax()\nprint(f'fastest growing region last month: {best}')",

    "Honeybees communicate the location of food with a dance. A forager returning to the hive walks in a figure of "
    "eight on the vertical comb, waggling her abdomen during the straight middle run. The angle of that run "
    "relative to vertical matches the angle between the food and the sun, and the length of the waggle phase "
    "grows with the distance to the flowers. Other bees follow the dancer in the dark, sensing the vibrations and "
    "the smell of nectar, and then fly out to search in the indicated direction.",

    "Terms of use (summary). You may use the service for personal and commercial projects. You must not upload "
    "content that you do not have the right to share, attempt to access other users' accounts, or send automated "
    "requests at a rate that degrades the service for others. We may suspend accounts that break these rules after "
    "a warning, or immediately in serious cases. Paid plans renew monthly and can be cancelled at any time; "
    "refunds are given for the unused part of an annual plan within 30 days of purchase.",

    "Exercise 4. Let f(x) = 3x^2 - 12x + 7.\n(a) Find the vertex of the parabola. Completing the square gives "
    "f(x) = 3(x - 2)^2 - 5, so the vertex is at (2, -5).\n(b) Find where f is increasing. The leading coefficient "
    "is positive, so f decreases for x < 2 and increases for x > 2.\n(c) Solve f(x) = 0. From 3(x - 2)^2 = 5 we get "
    "x = 2 +/- sqrt(5/3), approximately 0.709 and 3.291.\n(d) Compute the integral of f from 0 to 3: [x^3 - 6x^2 "
    "+ 7x] from 0 to 3 equals 27 - 54 + 21 = -6.",
)


def digest() -> str:
    """sha256 of the texts (recorded in the manifest, so a plan says which calibration set rounded it)."""
    return hashlib.sha256("\0".join(TEXTS).encode()).hexdigest()
